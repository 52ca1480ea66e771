"""Malformed index.json: always a typed error naming index.json (or the file at fault).

Most cases edit the parsed index and write it back *re-sealed* (reference.layouts.index.encode_index
recomputes index_sha256), so what is tested is the structural validation, not the checksum.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from resume_conformance import reference
from resume_conformance.reference.layouts.index import CHECKSUM_KEY, encode_index

from tests.strategies import trainer_payload


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    d = tmp_path_factory.mktemp("index") / "step-00000004"
    reference.save_sharded(trainer_payload(step=4), d, num_shards=2)
    return d


@pytest.fixture
def ckpt(template, tmp_path):
    return Path(shutil.copytree(template, tmp_path / "step-00000004"))


def _index(ckpt: Path) -> dict:
    return json.loads((ckpt / "index.json").read_text())


def _write_sealed(ckpt: Path, index) -> None:
    (ckpt / "index.json").write_bytes(encode_index(index))


def _refused(ckpt: Path, error=reference.InvalidIndexError, names=("index.json",)):
    for attempt in (reference.load, reference.verify, reference.load_sharded):
        with pytest.raises(error) as info:
            attempt(ckpt)
        assert any(name in str(info.value) for name in names), str(info.value)
    return info.value


def _shard(index: dict, i: int = 0) -> dict:
    return [f for f in index["files"] if f["role"] == "shard"][i]


def _meta(index: dict) -> dict:
    return next(f for f in index["files"] if f["role"] == "meta")


# -- edits of the parsed index --------------------------------------------------------------------

def _del(key):
    return lambda ix: ix.pop(key)


def _set(key, value):
    return lambda ix: ix.__setitem__(key, value)


def _entry(which, key, value=KeyError):
    def edit(ix):
        entry = _meta(ix) if which == "meta" else _shard(ix)
        if value is KeyError:
            del entry[key]
        else:
            entry[key] = value
    return edit


STRUCTURE_CASES = {
    # missing keys
    "no schema": _del("schema"), "no layout": _del("layout"), "no global_step": _del("global_step"),
    "no files": _del("files"),
    "entry without name": _entry("shard", "name"), "entry without role": _entry("meta", "role"),
    "entry without bytes": _entry("shard", "bytes"), "entry without sha256": _entry("meta", "sha256"),
    "shard without keys": _entry("shard", "keys"),
    # wrong types
    "global_step as string": _set("global_step", "4"), "global_step as float": _set("global_step", 4.0),
    "files as object": _set("files", {}), "layout as int": _set("layout", 1),
    "unknown layout": _set("layout", "flat"), "negative global_step": _set("global_step", -1),
    "bytes as string": _entry("shard", "bytes", "12"), "negative bytes": _entry("shard", "bytes", -1),
    "sha256 as int": _entry("meta", "sha256", 5), "sha256 uppercase": lambda ix: _meta(ix).update(
        sha256=_meta(ix)["sha256"].upper()),
    "sha256 too short": _entry("meta", "sha256", "ab" * 31), "keys as string": _entry("shard", "keys", "0.weight"),
    "keys with an int": _entry("shard", "keys", [0]), "unknown role": _entry("shard", "role", "weights"),
    "entry not an object": lambda ix: ix["files"].append("meta.pt"),
    "key_order not a list": _set("key_order", "0.weight"),
    "key_order missing a key": lambda ix: ix["key_order"].pop(),
    "key_order with an extra key": lambda ix: ix["key_order"].append("ghost"),
    "wall_saved_at as string": _set("wall_saved_at", "yesterday"),
    "metric as string": _set("metric", "low"),
    # bools where ints belong
    "global_step true": _set("global_step", True), "bytes false": _entry("shard", "bytes", False),
    "bytes true": _entry("meta", "bytes", True),
    # names
    "duplicate file name": lambda ix: _shard(ix, 1).update(name=_shard(ix, 0)["name"]),
    "two meta entries": lambda ix: ix["files"].append(dict(_meta(ix), name="meta2.pt")),
    "no meta entry": lambda ix: ix.update(files=[f for f in ix["files"] if f["role"] != "meta"]),
    "key listed in two shards": lambda ix: _shard(ix, 1)["keys"].append(_shard(ix, 0)["keys"][0]),
    "key listed twice in one shard": lambda ix: _shard(ix, 0)["keys"].append(_shard(ix, 0)["keys"][0]),
    "index lists itself": _entry("meta", "name", "index.json"),
}
for bad_name in ("../x", "a/b", ".hidden", "/etc/passwd", "..", ".", "", "a\\b", "x\x00y",
                 "../step-00000004/meta.pt", "./meta.pt"):
    STRUCTURE_CASES[f"name {bad_name!r}"] = _entry("shard", "name", bad_name)


@pytest.mark.parametrize("case", sorted(STRUCTURE_CASES))
def test_structurally_malformed_index_is_refused(ckpt, case):
    index = _index(ckpt)
    STRUCTURE_CASES[case](index)
    _write_sealed(ckpt, index)
    exc = _refused(ckpt, error=reference.CheckpointError)
    # schema problems are SchemaErrors, everything else an InvalidIndexError
    assert isinstance(exc, (reference.InvalidIndexError, reference.SchemaError))
    if case != "no schema":
        assert isinstance(exc, reference.InvalidIndexError), type(exc)


RAW_CASES = {
    "empty": b"", "truncated": None, "not json": b"index", "open brace": b"{",
    "non-utf8": b'{"schema": "\xff"}', "array": b"[]", "string": b'"index"', "number": b"3",
    "null": b"null", "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "duplicate json key": None, "nan global_step": None,
}


@pytest.mark.parametrize("case", sorted(RAW_CASES))
def test_unparseable_or_non_object_index_is_refused(ckpt, case):
    raw = RAW_CASES[case]
    original = (ckpt / "index.json").read_bytes()
    if case == "truncated":
        raw = original[: len(original) // 2]
    elif case == "duplicate json key":
        raw = original.replace(b'"layout": "sharded"', b'"layout": "sharded", "layout": "sharded"', 1)
        assert raw != original
    elif case == "nan global_step":
        raw = encode_index({**_index(ckpt), "global_step": float("nan")})
    (ckpt / "index.json").write_bytes(raw)
    _refused(ckpt)


def test_unsealed_index_is_refused(ckpt):
    index = _index(ckpt)
    del index[CHECKSUM_KEY]
    (ckpt / "index.json").write_text(json.dumps(index))
    exc = _refused(ckpt)
    assert CHECKSUM_KEY in str(exc)


def test_edit_without_resealing_is_refused(ckpt):
    index = _index(ckpt)
    index["global_step"] = 5  # valid on its own, but not what was committed
    (ckpt / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    exc = _refused(ckpt)
    assert "mismatch" in str(exc)


def test_resealed_reformatting_is_accepted(ckpt):
    """The checksum is over content: the same content in another layout still loads."""
    index = _index(ckpt)
    (ckpt / "index.json").write_text(json.dumps(index, separators=(",", ":")))
    reference.verify(ckpt)
    assert reference.load(ckpt)["counters"]["global_step"] == 4


def test_sizes_that_disagree_name_the_file(ckpt):
    index = _index(ckpt)
    shard = _shard(index)
    shard["bytes"] += 1
    _write_sealed(ckpt, index)
    _refused(ckpt, error=reference.CorruptCheckpointError, names=(shard["name"],))


def test_hash_that_disagrees_names_the_file(ckpt):
    index = _index(ckpt)
    meta = _meta(index)
    meta["sha256"] = hashlib.sha256(b"something else").hexdigest()
    _write_sealed(ckpt, index)
    _refused(ckpt, error=reference.CorruptCheckpointError, names=("meta.pt",))


def test_missing_listed_file_is_incomplete(ckpt):
    name = _shard(_index(ckpt), 1)["name"]
    (ckpt / name).unlink()
    _refused(ckpt, error=reference.IncompleteCheckpointError, names=(name,))


def test_listed_name_that_is_a_directory(ckpt):
    index = _index(ckpt)
    shard = _shard(index)
    (ckpt / shard["name"]).unlink()
    (ckpt / shard["name"]).mkdir()
    shard["bytes"] = os.stat(ckpt / shard["name"]).st_size
    _write_sealed(ckpt, index)
    _refused(ckpt, error=reference.CorruptCheckpointError, names=(shard["name"],))


def test_missing_index_is_incomplete(ckpt):
    (ckpt / "index.json").unlink()
    _refused(ckpt, error=reference.IncompleteCheckpointError, names=(str(ckpt),))


def test_index_that_is_a_directory(ckpt):
    (ckpt / "index.json").unlink()
    (ckpt / "index.json").mkdir()
    _refused(ckpt)


@pytest.mark.parametrize("target", ["relative", "absolute"])
def test_symlink_leaving_the_checkpoint_directory_is_refused(ckpt, tmp_path, target):
    """A listed file that is a symlink to a file outside, even with matching size and hash."""
    index = _index(ckpt)
    shard = _shard(index)
    outside = tmp_path / "outside.pt"
    shutil.move(ckpt / shard["name"], outside)
    os.symlink("../outside.pt" if target == "relative" else str(outside), ckpt / shard["name"])
    assert (ckpt / shard["name"]).read_bytes() == outside.read_bytes()
    _write_sealed(ckpt, index)
    exc = _refused(ckpt)
    assert "outside" in str(exc)


def test_symlink_inside_the_checkpoint_directory_is_allowed(ckpt):
    index = _index(ckpt)
    meta = _meta(index)
    os.rename(ckpt / "meta.pt", ckpt / "meta-real.pt")
    os.symlink("meta-real.pt", ckpt / "meta.pt")
    _write_sealed(ckpt, index)
    assert reference.load(ckpt)["counters"]["global_step"] == 4
    assert meta["name"] == "meta.pt"


def test_shard_content_that_disagrees_with_its_keys(ckpt):
    """A shard whose hash matches but whose parameter names differ from index.json's keys."""
    index = _index(ckpt)
    a, b = _shard(index, 0), _shard(index, 1)
    a["keys"], b["keys"] = b["keys"], a["keys"]
    index["key_order"] = a["keys"] + b["keys"]
    _write_sealed(ckpt, index)
    with pytest.raises(reference.CorruptCheckpointError) as info:
        reference.load(ckpt)
    assert a["name"] in str(info.value) or b["name"] in str(info.value)


def test_meta_schema_disagreeing_with_index_schema(ckpt):
    import torch
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    meta["schema"] = "reference-checkpoint/1"
    torch.save(meta, ckpt / "meta.pt")
    index = _index(ckpt)
    data = (ckpt / "meta.pt").read_bytes()
    _meta(index).update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    _write_sealed(ckpt, index)
    with pytest.raises(reference.CorruptCheckpointError) as info:
        reference.load(ckpt)
    assert "meta.pt" in str(info.value)


def test_validate_index_accepts_what_save_sharded_writes(template):
    index = reference.layouts.index.read_index(template)
    assert reference.layouts.index.validate_index(copy.deepcopy(index), template) == index
