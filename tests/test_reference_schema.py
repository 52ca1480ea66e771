"""Schema versions: every payload and index carries one, v1 samples migrate, unknown ones refuse."""
from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest
import torch
from resume_conformance import reference
from resume_conformance.reference.layouts.index import encode_index
from resume_conformance.reference.layouts.single_file import _write_with_checksum
from resume_conformance.reference.primitives.atomic import atomic_write

from tests.strategies import assert_same, trainer_objects, trainer_payload

LEGACY = Path(__file__).resolve().parent.parent / "fixtures" / "legacy"
V1_FILE = LEGACY / "v1-file" / "step-00000007.pt"
V1_SHARDED = LEGACY / "v1-sharded" / "step-00000007"
SCRIPT = LEGACY / "make_v1_samples.py"


@pytest.fixture(scope="module")
def generator():
    return runpy.run_path(str(SCRIPT), run_name="make_v1_samples")


# -- the checked-in v1 samples --------------------------------------------------------------------

def test_v1_samples_are_checked_in_and_small():
    files = [V1_FILE] + sorted(V1_SHARDED.iterdir())
    assert [f.name for f in files[1:]] == ["index.json", "meta.pt", "model-00000-of-00002.pt",
                                           "model-00001-of-00002.pt"]
    for f in files:
        assert 0 < f.stat().st_size < 100_000, f
    assert json.loads((V1_SHARDED / "index.json").read_text())["schema"] == "reference-checkpoint/1"
    raw = torch.load(V1_FILE, weights_only=True)
    assert raw["schema"] == "reference-checkpoint/1" and "integrity" not in raw
    assert {"step", "epoch", "samples_in_epoch", "batch_size", "losses"} <= raw.keys()


@pytest.mark.parametrize("sample", [V1_FILE, V1_SHARDED], ids=["file", "sharded"])
def test_v1_sample_migrates(sample):
    raw = (reference.load_file(sample, migrate_schema=False) if sample.is_file()
           else reference.load_sharded(sample, migrate_schema=False))
    assert raw["schema"] == "reference-checkpoint/1"
    payload = reference.load(sample)
    assert payload["schema"] == reference.CURRENT_SCHEMA == "reference-checkpoint/2"
    assert payload["counters"] == {"global_step": raw["step"], "epoch": raw["epoch"],
                                   "batch_in_epoch": raw["samples_in_epoch"] // raw["batch_size"]}
    assert payload["counters"] == {"global_step": 7, "epoch": 1, "batch_in_epoch": 2}
    assert payload["loss_history"] == raw["losses"] and len(payload["loss_history"]) == 7
    for gone in ("step", "samples_in_epoch", "batch_size", "losses"):
        assert gone not in payload
    assert payload["wall_saved_at"] is None and payload["data_order"] is None
    assert payload["scaler"] is None and payload["extra"] == {}

    state = reference.TrainState.from_payload(payload, path=str(sample))
    assert (state.global_step, state.epoch, state.batch_in_epoch) == (7, 1, 2)
    model, optimizer, scheduler = trainer_objects(seed=5, dtype=torch.float64)   # the trainer's dtype
    state.restore(model, optimizer, scheduler)
    for k, v in model.state_dict().items():
        assert torch.equal(v, raw["model"][k])
    assert scheduler.state_dict()["last_epoch"] == 7
    assert optimizer.state_dict()["state"][0]["step"] == 7


def test_v1_file_and_sharded_samples_hold_the_same_state():
    a, b = reference.load(V1_FILE), reference.load(V1_SHARDED)
    # a v1 index has no key_order: the sharded model comes back in shard order
    b["model"] = {k: b["model"][k] for k in a["model"]}
    assert_same({k: b[k] for k in a}, a)


def test_v1_samples_are_reproducible(generator, tmp_path):
    """The script regenerates byte-identical files; the checked-in ones hold the same values, on
    any CPU (the trainer computes in float64: float32 kernels round differently per ISA)."""
    first = generator["write_samples"](tmp_path / "a")
    second = generator["write_samples"](tmp_path / "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    fresh = reference.load(tmp_path / "a" / "v1-file" / "step-00000007.pt")
    checked_in = reference.load(V1_FILE)
    assert fresh["counters"] == checked_in["counters"]
    for k, v in checked_in["model"].items():
        torch.testing.assert_close(fresh["model"][k], v, rtol=1e-9, atol=1e-12)


def test_fsck_and_manager_accept_v1_samples(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(V1_SHARDED, run / V1_SHARDED.name)
    shutil.copy(V1_FILE, run / "step-00000005.pt")
    manager = reference.CheckpointManager(run)
    assert manager.latest().step == 7
    assert manager.load_latest()["counters"]["global_step"] == 7
    from resume_conformance.reference.cli.fsck import scan
    assert [r[2] for r in scan(run)] == ["valid", "valid"]


# -- every payload and index carries the current schema ---------------------------------------------

def test_saved_payload_and_index_carry_the_schema(tmp_path):
    payload = trainer_payload()
    reference.save_file(payload, tmp_path / "f.pt")
    assert torch.load(tmp_path / "f.pt", weights_only=True)["schema"] == reference.CURRENT_SCHEMA
    reference.save_sharded(payload, tmp_path / "s")
    assert json.loads((tmp_path / "s" / "index.json").read_text())["schema"] == reference.CURRENT_SCHEMA
    assert torch.load(tmp_path / "s" / "meta.pt", weights_only=True)["schema"] == reference.CURRENT_SCHEMA


@pytest.mark.parametrize("schema", [None, 3, "reference-checkpoint/99", "other/1"])
def test_saving_an_unknown_schema_is_refused(tmp_path, schema):
    payload = trainer_payload()
    payload["schema"] = schema
    for save, target in ((reference.save_file, tmp_path / "f.pt"), (reference.save_sharded, tmp_path / "s")):
        with pytest.raises(reference.SchemaError):
            save(payload, target)
        assert not target.exists()


# -- unknown, newer, missing schemas on load ----------------------------------------------------------

def _write_single(path: Path, payload: dict) -> None:
    """A single file as save_file writes it (whole-file checksum included) but with any schema,
    so that only the schema is wrong."""
    atomic_write(path, lambda sink: _write_with_checksum(payload, sink))


NEWER = "reference-checkpoint/99"


@pytest.mark.parametrize("schema,expected", [
    (NEWER, ["reference-checkpoint/99", "reference-checkpoint/2", "newer"]),
    ("other/1", ["other/1", "reference-checkpoint/2", "unknown"]),
    ("reference-checkpoint/0", ["reference-checkpoint/0", "reference-checkpoint/2"]),
    ("reference-checkpoint/2\n", ["unknown"]),
    (2, ["schema must be a string"]),
    ("missing", ["no 'schema'"]),
])
def test_single_file_with_unknown_schema(tmp_path, schema, expected):
    payload = trainer_payload()
    if schema == "missing":
        del payload["schema"]
    else:
        payload["schema"] = schema
    path = tmp_path / "step-00000001.pt"
    _write_single(path, payload)
    with pytest.raises(reference.SchemaError) as info:
        reference.load_file(path)
    assert str(path) in str(info.value)
    for text in expected:
        assert text in str(info.value)


@pytest.mark.parametrize("schema,expected", [
    (NEWER, ["reference-checkpoint/99", "reference-checkpoint/2"]),
    ("other/1", ["other/1", "reference-checkpoint/2"]),
    ("missing", ["schema"]),
])
def test_sharded_index_with_unknown_schema(tmp_path, schema, expected):
    d = tmp_path / "step-00000001"
    reference.save_sharded(trainer_payload(), d)
    index = json.loads((d / "index.json").read_text())
    if schema == "missing":
        del index["schema"]
    else:
        index["schema"] = schema
    (d / "index.json").write_bytes(encode_index(index))
    with pytest.raises(reference.CheckpointError) as info:
        reference.load(d)
    assert "index.json" in str(info.value)
    if schema != "missing":
        assert isinstance(info.value, reference.SchemaError)
    for text in expected:
        assert text in str(info.value)


def test_migrate_refuses_unmigratable_v1():
    base = {"schema": "reference-checkpoint/1", "step": 1, "epoch": 0, "samples_in_epoch": 8,
            "batch_size": 8, "losses": [], "model": {}, "rng": {}}
    assert reference.migrate(dict(base))["counters"]["batch_in_epoch"] == 1
    for broken in ({"batch_size": 0}, {"batch_size": None}, {"step": "x"}):
        with pytest.raises(reference.SchemaError, match="cannot migrate"):
            reference.migrate({**base, **broken}, "some/path.pt")
    without = dict(base)
    del without["batch_size"]
    with pytest.raises(reference.SchemaError, match="reference-checkpoint/1 -> reference-checkpoint/2"):
        reference.migrate(without)
    with pytest.raises(reference.SchemaError):
        reference.migrate({"model": {}})


def test_a_migration_can_only_be_registered_once():
    with pytest.raises(ValueError):
        reference.register_migration(1)(lambda payload: payload)
