"""A flipped bit or a cut anywhere in a checkpoint is a typed CheckpointError naming the file.

The one honest exception is index.json, which is text: a change that leaves its JSON content
identical (dropping the final newline, whitespace, an exponent's 'e' turned 'E') is harmless and
may load, but then the loaded payload must be the original one. Any change of content is refused.
"""
from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resume_conformance import reference
from resume_conformance.reference.layouts.single_file import FILE_CHECKSUM_MAGIC

from tests.strategies import assert_same, checkpoint_files, copy_checkpoint, flip_bit, trainer_payload, truncate

SETTINGS = settings(max_examples=50, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    # metric 1e-05 is written as "1e-05": its 'e' -> 'E' flip is a same-content change
    payload = trainer_payload(step=12, loss_history=[0.5, 0.25], extra={"metric": 1e-05})
    sharded = root / "step-00000012"
    reference.save_sharded(payload, sharded, num_shards=2)
    single = root / "step-00000012.pt"
    reference.save_file(payload, single)
    return {"sharded": sharded, "single": single,
            "expected_sharded": reference.load(sharded), "expected_single": reference.load(single)}


def _mutations(sizes: dict[str, int]):
    """(file name, ("flip", offset, bit) | ("truncate", new_size))."""
    names = sorted(sizes)

    @st.composite
    def draw(draw):
        name = draw(st.sampled_from(names))
        size = sizes[name]
        if draw(st.booleans()):
            return name, ("flip", draw(st.integers(0, size - 1)), draw(st.integers(0, 7)))
        return name, ("truncate", draw(st.integers(0, size - 1)))
    return draw()


def _apply(path: Path, mutation) -> None:
    if mutation[0] == "flip":
        flip_bit(path, mutation[1], mutation[2])
    else:
        truncate(path, mutation[1])


def _check_refused_or_same(ckpt: Path, name: str, original_bytes: bytes, expected) -> None:
    try:
        loaded = reference.load(ckpt)
    except reference.CheckpointError as exc:
        assert name in str(exc), f"error does not name {name}: {exc}"
        with pytest.raises(reference.CheckpointError):
            reference.verify(ckpt)
        return
    # Loaded without an error: only acceptable for a same-content change of index.json.
    assert name == "index.json", f"silent load after damaging {name}"
    mutated = (ckpt / name).read_bytes()
    assert json.loads(mutated) == json.loads(original_bytes), \
        f"index.json changed meaning and still loaded: {original_bytes!r} -> {mutated!r}"
    assert_same(loaded, expected)


def test_sharded_fixture_has_the_expected_files(pristine):
    names = [p.name for p in checkpoint_files(pristine["sharded"])]
    assert names == ["index.json", "meta.pt", "model-00000-of-00002.pt", "model-00001-of-00002.pt"]


@SETTINGS
@given(data=st.data())
def test_any_flip_or_cut_in_a_sharded_checkpoint_is_refused(pristine, data):
    files = {p.name: p.stat().st_size for p in checkpoint_files(pristine["sharded"])}
    name, mutation = data.draw(_mutations(files))
    with tempfile.TemporaryDirectory() as d:
        ckpt = copy_checkpoint(pristine["sharded"], Path(d) / "step-00000012")
        original = (ckpt / name).read_bytes()
        _apply(ckpt / name, mutation)
        _check_refused_or_same(ckpt, name, original, pristine["expected_sharded"])


@SETTINGS
@given(data=st.data())
def test_any_flip_or_cut_in_a_single_file_is_refused(pristine, data):
    size = pristine["single"].stat().st_size
    name, mutation = data.draw(_mutations({pristine["single"].name: size}))
    with tempfile.TemporaryDirectory() as d:
        ckpt = copy_checkpoint(pristine["single"], Path(d) / name)
        _apply(ckpt, mutation)
        with pytest.raises(reference.CheckpointError) as info:
            reference.load(ckpt)
        assert str(ckpt) in str(info.value)


def test_every_byte_of_index_json_flipped_or_cut(pristine, tmp_path):
    """Exhaustive over index.json's offsets: a flip of one bit (cycling through the 8) at each
    byte, and a cut at every 5th offset and at the last ones. (Hypothesis above draws arbitrary
    bits and offsets.)"""
    ckpt = copy_checkpoint(pristine["sharded"], tmp_path / "step-00000012")
    index = ckpt / "index.json"
    original = index.read_bytes()
    accepted = []
    for offset in range(len(original)):
        cut = offset % 5 == 0 or offset >= len(original) - 3
        for mutation in (("flip", offset, offset % 8),) + ((("truncate", offset),) if cut else ()):
            index.write_bytes(original)
            _apply(index, mutation)
            try:
                reference.verify_sharded(ckpt, max_workers=1)  # (no thread pool per call)
            except reference.CheckpointError as exc:
                assert "index.json" in str(exc)
                continue
            assert json.loads(index.read_bytes()) == json.loads(original), mutation
            accepted.append(mutation)
    index.write_bytes(original)
    assert_same(reference.load(ckpt), pristine["expected_sharded"])
    # Only same-content changes got through: dropping the final newline, and 'e' -> 'E' in 1e-05.
    assert ("truncate", len(original) - 1) in accepted
    assert all(m == ("truncate", len(original) - 1) or original[m[1]:m[1] + 1] == b"e" for m in accepted)


def test_every_bit_of_the_single_file_trailer(pristine, tmp_path):
    """The zip end record (every bit) and the checksum comment (two bits of each byte)."""
    ckpt = copy_checkpoint(pristine["single"], tmp_path / pristine["single"].name)
    original = ckpt.read_bytes()
    tail = 22 + len(FILE_CHECKSUM_MAGIC) + 64
    assert original[-tail:-tail + 4] == b"PK\x05\x06"
    for offset in range(len(original) - tail, len(original)):
        in_end_record = offset < len(original) - tail + 22
        for bit in (range(8) if in_end_record else (offset % 8, (offset + 4) % 8)):
            ckpt.write_bytes(original)
            flip_bit(ckpt, offset, bit)
            with pytest.raises(reference.CheckpointError) as info:
                reference.load_file(ckpt)
            assert str(ckpt) in str(info.value)


def test_a_checkpoint_without_the_whole_file_checksum_is_refused(pristine, tmp_path):
    """Cutting exactly the checksum comment (and resetting its length) leaves a valid zip with a
    valid payload digest: still refused, every current-schema file carries the checksum."""
    data = pristine["single"].read_bytes()
    comment = 2 + len(FILE_CHECKSUM_MAGIC) + 64
    stripped = tmp_path / "stripped.pt"
    stripped.write_bytes(data[:-comment] + b"\x00\x00")
    with pytest.raises(reference.CorruptCheckpointError, match="whole-file checksum") as info:
        reference.load_file(stripped)
    assert str(stripped) in str(info.value)


def test_a_damaged_newer_checkpoint_is_skipped_with_a_warning_naming_it(pristine, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    good = copy_checkpoint(pristine["sharded"], run / "step-00000012")
    bad = copy_checkpoint(pristine["sharded"], run / "step-00000013")
    shard = bad / "model-00001-of-00002.pt"
    flip_bit(shard, shard.stat().st_size // 2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = reference.latest_valid(run)
    assert info is not None and info.path == good
    messages = [str(w.message) for w in caught if issubclass(w.category, reference.CheckpointSkippedWarning)]
    assert len(messages) == 1 and str(bad) in messages[0] and shard.name in messages[0]
