"""Round trip: whatever goes into save_file / save_sharded comes back bit-exact."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resume_conformance import reference
from resume_conformance.reference.layouts.index import CHECKSUM_KEY, index_checksum
from resume_conformance.reference.primitives.integrity import tree_digest

from tests.strategies import assert_same, payloads, trainer_payload

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

GROUPINGS = [
    ("round-robin", 1), ("round-robin", 2), ("round-robin", 3), ("round-robin", 7),
    ("suffix", None),
    ("first-char", lambda k: k[:1]),          # "" for the empty key: must still get a safe name
    ("length-mod-3", lambda k: len(k) % 3),   # not even a string
    ("unsafe-names", lambda k: "../" + k.replace(".", "/")),  # sanitised, never a path
]


def _in_order_of(loaded: dict, expected: dict) -> dict:
    """A sharded checkpoint stores `model` apart from the rest, so the payload's top-level key
    order is not kept (nested order is): compare the top level as a mapping."""
    assert sorted(loaded) == sorted(expected)
    return {k: loaded[k] for k in expected}


def _shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@SETTINGS
@given(payload=payloads())
def test_single_file_round_trip(payload):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ckpt.pt"
        size, digest = reference.save_file(payload, path)
        assert size == path.stat().st_size
        loaded = reference.load_file(path)
        assert_same(loaded, payload)
        # views stay views of one storage in a single file
        model, original = loaded["model"], payload["model"]
        for a in original:
            for b in original:
                if a != b and original[a].numel() and original[b].numel() and _shared(original[a], original[b]):
                    assert _shared(model[a], model[b]), f"{a} and {b} no longer share storage"


@SETTINGS
@given(payload=payloads(), grouping=st.sampled_from(GROUPINGS), workers=st.sampled_from([None, 1, 3]))
def test_sharded_round_trip(payload, grouping, workers):
    kind, arg = grouping
    kw = {"num_shards": arg} if kind == "round-robin" else {"group_by": arg}
    with tempfile.TemporaryDirectory() as d:
        directory = Path(d) / "ckpt"
        index = reference.save_sharded(payload, directory, max_workers=workers, **kw)
        assert (directory / "index.json").is_file()
        on_disk = json.loads((directory / "index.json").read_text())
        assert on_disk["schema"] == reference.CURRENT_SCHEMA
        assert on_disk[CHECKSUM_KEY] == index_checksum(on_disk)
        listed = sorted(k for f in on_disk["files"] if f["role"] == "shard" for k in f["keys"])
        assert listed == sorted(payload["model"])
        for f in on_disk["files"]:
            assert (directory / f["name"]).resolve().parent == directory.resolve()
            assert not f["name"].startswith(".")
        if kind == "round-robin":
            shards = [f for f in on_disk["files"] if f["role"] == "shard"]
            assert len(shards) <= arg
        assert index["files"] == on_disk["files"]
        loaded = reference.load(directory) if workers is None else \
            reference.load_sharded(directory, max_workers=workers)
        assert_same(_in_order_of(loaded, payload), payload)


def test_sharded_round_trip_of_trainer_state_keeps_key_order(tmp_path):
    payload = trainer_payload(step=5, loss_history=[1.0, 0.5], extra={"metric": 0.25})
    for kw in ({"num_shards": 3}, {"group_by": "suffix"}):
        d = tmp_path / repr(kw).replace(" ", "")
        reference.save_sharded(payload, d, **kw)
        loaded = reference.load_sharded(d)
        assert list(loaded["model"]) == list(payload["model"])
        assert_same(_in_order_of(loaded, payload), payload)
        assert json.loads((d / "index.json").read_text())["metric"] == 0.25


def test_suffix_grouping_puts_each_suffix_in_its_own_file():
    plan = reference.plan_shards(["a.weight", "a.bias", "b.weight", "bn.running_mean", "plain"],
                                 group_by="suffix")
    assert plan == {"model-weight.pt": ["a.weight", "b.weight"], "model-bias.pt": ["a.bias"],
                    "model-running_mean.pt": ["bn.running_mean"], "model-plain.pt": ["plain"]}


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_num_shards_is_refused_before_touching_disk(tmp_path, bad):
    with pytest.raises(ValueError):
        reference.save_sharded(trainer_payload(), tmp_path / "x", num_shards=bad)
    assert not (tmp_path / "x").exists()


def test_model_keys_must_be_strings(tmp_path):
    payload = {"schema": reference.CURRENT_SCHEMA, "model": {0: torch.zeros(1)}}
    with pytest.raises(ValueError):
        reference.save_sharded(payload, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_overwriting_a_sharded_checkpoint_commits_the_new_content(tmp_path):
    d = tmp_path / "ckpt"
    first = trainer_payload(step=1)
    second = trainer_payload(step=2)
    second["model"] = {k: v + 1 if v.is_floating_point() else v for k, v in second["model"].items()}
    reference.save_sharded(first, d, num_shards=2)
    reference.save_sharded(second, d, group_by="suffix")  # a different set of file names
    assert_same(_in_order_of(reference.load_sharded(d), second), second)


def test_save_file_refuses_a_payload_carrying_integrity(tmp_path):
    with pytest.raises(ValueError):
        reference.save_file({"schema": reference.CURRENT_SCHEMA, "integrity": {}}, tmp_path / "x.pt")


def test_tree_digest_ignores_set_iteration_order():
    # {1, 9} and {9, 1} collide in an 8-slot table: equal sets, different iteration order. For
    # strings the order also differs between processes (hash randomisation), so a digest that
    # followed iteration order would call a good checkpoint corrupt in another process.
    a, b = set(), set()
    a.add(1), a.add(9)
    b.add(9), b.add(1)
    assert a == b and list(a) != list(b)
    assert tree_digest({"s": a}) == tree_digest({"s": b})
    assert tree_digest({"s": {1, 9}}) != tree_digest({"s": {1, 10}})


def test_tree_digest_sees_dtype_shape_and_structure():
    base = {"t": torch.zeros(4, dtype=torch.float32)}
    variants = [{"t": torch.zeros(4, dtype=torch.int32)}, {"t": torch.zeros(2, 2)},
                {"t": [torch.zeros(4)]}, {"u": torch.zeros(4)}, {"t": torch.zeros(4), "x": None}]
    digests = {tree_digest(v) for v in variants}
    assert tree_digest(base) not in digests and len(digests) == len(variants)
    assert tree_digest({"x": (1, 2)}) != tree_digest({"x": [1, 2]})
    assert tree_digest({"x": 1}) != tree_digest({"x": 1.0}) != tree_digest({"x": True})
