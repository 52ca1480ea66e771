"""fixtures/commit_marker_trainer.py: a trainer whose checkpointing is independent of reference/.

Fast, in-process, no strace: round trip, corruption fallback, what the loader ignores, step
ordering, retention, schema refusal and the v1 legacy sample."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")

import torch
from resume_conformance.fixtures import commit_marker_trainer as cm
from resume_conformance.fixtures.contract import RunConfig
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

LEGACY_V1 = Path(cm.__file__).parent / "legacy" / "commit-marker-v1" / "ckpt-7"


def make_trainer(tmp_path: Path, total: int, save_every: int, *, seed: int = 0, log: str = "loss.jsonl",
                 cls=cm.CommitMarkerTrainer) -> cm.CommitMarkerTrainer:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = RunConfig(tmp_path / "ckpt", total, save_every, seed, tmp_path / log)
    return cls(cfg)


def run(tmp_path: Path, total: int, save_every: int, **kw) -> cm.CommitMarkerTrainer:
    trainer = make_trainer(tmp_path, total, save_every, **kw)
    assert trainer.run() == 0
    return trainer


def load(tmp_path: Path) -> tuple[dict | None, list[str]]:
    """load_latest on a fresh store; (payload, warning messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        payload = cm.CommitMarkerStore(tmp_path / "ckpt").load_latest()
    return payload, [str(w.message) for w in caught if issubclass(w.category, cm.CheckpointSkippedWarning)]


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (list(a), list(b))
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b), (a, b)


def recommit(ckpt: Path, *, schema: str | None = None, files: dict[str, bytes] | None = None) -> None:
    """Rewrite files of a checkpoint (and its schema) and its COMMIT so that every hash matches again."""
    commit = json.loads((ckpt / cm.COMMIT).read_text())
    for name, data in (files or {}).items():
        (ckpt / name).write_bytes(data)
    if schema is not None:
        state = json.loads((ckpt / cm.STATE_FILE).read_text())
        state["schema"] = schema
        (ckpt / cm.STATE_FILE).write_text(json.dumps(state))
    entries = []
    for name in cm.REQUIRED_FILES:
        data = (ckpt / name).read_bytes()
        entries.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    (ckpt / cm.COMMIT).write_bytes(cm.commit_marker(schema or commit["schema"], commit["step"], entries))


# -- round trip -------------------------------------------------------------------------------------
def test_save_load_round_trip_restores_identical_state(tmp_path):
    a = run(tmp_path, 7, 0)                   # mid-epoch (epoch 1, 2 batches in), nothing saved yet
    a.save()
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    expect = {"model": a.model.state_dict(), "optimizer": a.optimizer.state_dict(),
              "scheduler": a.scheduler.state_dict(), "sampler": a.sampler.state_dict()}

    b = make_trainer(tmp_path, 7, 0, log="b.jsonl")       # reseeds every RNG, fresh objects
    payload, skipped = load(tmp_path)
    assert payload is not None and not skipped
    b.restore(payload)
    assert b.global_step == 7 and b.losses == a.losses
    assert_same(expect["model"], b.model.state_dict())
    assert_same(expect["optimizer"], b.optimizer.state_dict())
    assert_same(expect["scheduler"], b.scheduler.state_dict())
    assert_same(expect["sampler"], b.sampler.state_dict())
    after = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    assert after[0] == rng[0]
    assert all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(after[1], rng[1]))
    assert torch.equal(after[2], rng[2])
    # and both go on identically (the RNGs are process-global: give each step the same start)
    batch = next(iter(a.sampler))
    assert next(iter(b.sampler)) == batch
    start = cm.capture_rng()
    loss_a = a.train_step(batch)
    cm.restore_rng(start, tmp_path)
    assert b.train_step(batch) == loss_a


def test_resumed_run_matches_uninterrupted_run(tmp_path):
    full = tmp_path / "full"
    run(full, 12, 3)
    part = tmp_path / "part"
    run(part, 8, 3, log="a.jsonl")            # last checkpoint: step 6
    run(part, 12, 3, log="b.jsonl")
    resumed = losses(part / "b.jsonl")
    assert min(resumed) == 7
    base = losses(full / "loss.jsonl")
    assert all(abs(resumed[s] - base[s]) <= 1e-6 for s in resumed)


def test_files_hold_no_pickle_and_tensors_are_safetensors(tmp_path):
    run(tmp_path, 3, 3)
    ckpt = tmp_path / "ckpt" / "ckpt-3"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([cm.COMMIT, *cm.REQUIRED_FILES])
    model = st_load((ckpt / cm.MODEL_FILE).read_bytes())
    assert "1.running_mean" in model and "1.num_batches_tracked" in model      # BatchNorm buffers
    rng = st_load((ckpt / cm.RNG_FILE).read_bytes())
    assert {"rng.torch_cpu", "rng.numpy.key", "data_order.generator_at_epoch_start"} <= set(rng)
    for f in ckpt.iterdir():
        assert not f.read_bytes().startswith(b"\x80"), f"{f.name} looks like a pickle"
    commit = json.loads((ckpt / cm.COMMIT).read_text())
    assert commit["schema"] == cm.CURRENT_SCHEMA and commit["step"] == 3


# -- corruption -------------------------------------------------------------------------------------
def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _bitflip(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["truncate", "bitflip", "delete"])
@pytest.mark.parametrize("name", [cm.MODEL_FILE, cm.OPTIMIZER_FILE, cm.RNG_FILE, cm.STATE_FILE, cm.COMMIT])
def test_damaged_newest_is_skipped_with_a_warning_naming_the_file(tmp_path, kind, name):
    run(tmp_path, 6, 3)
    target = tmp_path / "ckpt" / "ckpt-6" / name
    {"truncate": _truncate, "bitflip": _bitflip, "delete": Path.unlink}[kind](target)
    payload, skipped = load(tmp_path)
    assert payload is not None and payload["global_step"] == 3
    assert len(skipped) == 1 and name in skipped[0] and "ckpt-6" in skipped[0], skipped


def test_code_running_pickle_in_place_of_a_file_never_runs(tmp_path):
    run(tmp_path, 6, 3)
    marker = tmp_path / "RAN"

    class RunsCode:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    for name in cm.REQUIRED_FILES:
        (tmp_path / "ckpt" / "ckpt-6" / name).write_bytes(pickle.dumps({"x": RunsCode()}))
    payload, skipped = load(tmp_path)
    assert payload["global_step"] == 3 and skipped
    assert not marker.exists()


def test_all_damaged_means_fresh_start_never_bad_data(tmp_path):
    run(tmp_path, 6, 3)
    for step in (3, 6):
        _bitflip(tmp_path / "ckpt" / f"ckpt-{step}" / cm.MODEL_FILE)
    payload, skipped = load(tmp_path)
    assert payload is None and len(skipped) == 2


def test_a_restore_failure_raises(tmp_path):
    run(tmp_path, 3, 3)
    ckpt = tmp_path / "ckpt" / "ckpt-3"
    rng = st_load((ckpt / cm.RNG_FILE).read_bytes())
    rng["rng.torch_cpu"] = rng["rng.torch_cpu"][:100].clone()     # a torch RNG state of the wrong size
    recommit(ckpt, files={cm.RNG_FILE: st_save(rng)})
    payload, skipped = load(tmp_path)
    assert payload is not None and not skipped                    # it verifies: the hashes match
    with pytest.raises(cm.RestoreError, match="ckpt-3.*RNG"):
        make_trainer(tmp_path, 6, 3, log="b.jsonl").restore(payload)


# -- what the loader ignores, and ordering ----------------------------------------------------------
def test_temp_dirs_and_uncommitted_dirs_are_ignored(tmp_path):
    run(tmp_path, 6, 3)
    root = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt-6", root / ".tmp-ckpt-9-4242")                  # a whole, unrenamed save
    shutil.copytree(root / "ckpt-6", root / "ckpt-12")
    (root / "ckpt-12" / cm.COMMIT).unlink()                                     # never committed
    payload, skipped = load(tmp_path)
    assert payload["global_step"] == 6
    assert len(skipped) == 1 and "ckpt-12" in skipped[0] and "COMMIT" in skipped[0], skipped
    assert not any(".tmp-ckpt" in s for s in skipped)


def test_leftover_temp_dir_of_a_dead_writer_is_removed_after_a_commit(tmp_path):
    run(tmp_path, 3, 3)
    root = tmp_path / "ckpt"
    dead = os.getpid()
    while cm._alive(dead):
        dead += 1
    shutil.copytree(root / "ckpt-3", root / f".tmp-ckpt-6-{dead}")
    run(tmp_path, 6, 3, log="b.jsonl")
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-3", "ckpt-6"]


def test_ckpt_10_is_newer_than_ckpt_9(tmp_path):
    class KeepAll(cm.CommitMarkerTrainer):
        keep_last = 100

    run(tmp_path, 10, 1, cls=KeepAll)
    listed = [s for s, _ in cm.list_checkpoints(tmp_path / "ckpt")]
    assert listed == list(range(10, 0, -1))
    payload, _ = load(tmp_path)
    assert payload["global_step"] == 10
    _truncate(tmp_path / "ckpt" / "ckpt-10" / cm.MODEL_FILE)
    payload, skipped = load(tmp_path)
    assert payload["global_step"] == 9 and "ckpt-10" in skipped[0]


def test_retention_keeps_the_newest_two_and_ignores_foreign_newer_dirs(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "ckpt-100").mkdir()                       # foreign, uncommitted, higher-numbered
    with pytest.warns(cm.CheckpointSkippedWarning, match="ckpt-100/COMMIT: missing"):
        run(tmp_path, 12, 3)
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-100", "ckpt-12", "ckpt-9"]


def test_a_damaged_checkpoint_at_the_same_step_is_replaced(tmp_path):
    run(tmp_path, 6, 3)
    _bitflip(tmp_path / "ckpt" / "ckpt-6" / cm.OPTIMIZER_FILE)
    with pytest.warns(cm.CheckpointSkippedWarning, match="optimizer.safetensors"):
        run(tmp_path, 6, 3, log="b.jsonl")            # resumes from 3, saves 6 again
    payload, skipped = load(tmp_path)
    assert payload["global_step"] == 6 and not skipped


# -- schema -----------------------------------------------------------------------------------------
def test_newer_schema_raises_naming_the_file_and_both_versions(tmp_path):
    run(tmp_path, 6, 3)
    recommit(tmp_path / "ckpt" / "ckpt-6", schema="commit-marker/3")
    with pytest.raises(cm.SchemaError) as info:
        cm.CommitMarkerStore(tmp_path / "ckpt").load_latest()
    msg = str(info.value)
    assert "commit-marker/3" in msg and cm.CURRENT_SCHEMA in msg and "ckpt-6" in msg and "COMMIT" in msg


def test_unknown_schema_raises_and_main_exits_nonzero_with_a_message(tmp_path, monkeypatch, capsys):
    run(tmp_path, 6, 3)
    recommit(tmp_path / "ckpt" / "ckpt-6", schema="someone-else/1")
    for key, value in {"CONFORMANCE_CKPT_DIR": tmp_path / "ckpt", "CONFORMANCE_TOTAL_STEPS": 9,
                       "CONFORMANCE_SAVE_EVERY": 3, "CONFORMANCE_SEED": 0,
                       "CONFORMANCE_LOSS_LOG": tmp_path / "c.jsonl"}.items():
        monkeypatch.setenv(key, str(value))
    assert cm.main() == 3
    err = capsys.readouterr().err
    assert "cannot resume" in err and "someone-else/1" in err and cm.CURRENT_SCHEMA in err


@pytest.mark.skipif(not LEGACY_V1.is_dir(), reason="legacy sample not generated")
def test_v1_sample_migrates_and_continues_the_uninterrupted_curve(tmp_path):
    run(tmp_path / "full", 12, 3)
    shutil.copytree(LEGACY_V1, tmp_path / "ckpt" / "ckpt-7")
    payload, skipped = load(tmp_path)
    assert not skipped and payload["schema"] == "commit-marker/1"
    assert (payload["global_step"], payload["epoch"], payload["batch_in_epoch"]) == (7, 1, 2)
    assert payload["data_order"] is None
    run(tmp_path, 12, 3, log="resumed.jsonl")
    resumed, base = losses(tmp_path / "resumed.jsonl"), losses(tmp_path / "full" / "loss.jsonl")
    assert sorted(resumed) == list(range(8, 13))
    assert all(abs(resumed[s] - base[s]) <= 1e-6 for s in resumed)


def test_adapter_declares_the_legacy_sample():
    assert cm.ADAPTER.spec == "resume_conformance.fixtures.commit_marker_trainer:ADAPTER"
    assert {"syscall_crash", "sharded"} <= cm.ADAPTER.capabilities
    assert [(s.name, s.seed, s.step) for s in cm.ADAPTER.legacy_samples] == [("ckpt-7", 0, 7)]
