"""The reference library and its bundled trainer across a job's life (issue 25's checks, in-process):
Ctrl-C inside a save commits nothing, retention runs only after the commit so a damaged newest
checkpoint falls back to the one kept beside it, checkpoints hold no numpy pickles (they load under
any numpy), and the trainer neither re-trains a finished run nor refuses to extend one."""
from __future__ import annotations

import json
import os
import pickletools
import warnings
import zipfile
from pathlib import Path

import pytest
from resume_conformance import reference
from resume_conformance.fixtures.contract import RunConfig
from resume_conformance.fixtures.reference_trainer import ReferenceTrainer

from tests.strategies import trainer_payload


def _manager(run: Path, **kw) -> reference.CheckpointManager:
    return reference.CheckpointManager(run, every_steps=1, keep_last=2, layout="sharded", **kw)


def _steps(run: Path) -> list[int]:
    return [info.step for info in reference.list_checkpoints(run)]


@pytest.mark.parametrize("nth_fsync", [1, 2, 3])
def test_a_keyboard_interrupt_inside_a_save_commits_nothing_and_keeps_what_was_there(tmp_path, monkeypatch, nth_fsync):
    manager = _manager(tmp_path)
    for step in (1, 2):
        manager.save(trainer_payload(step=step), step=step)
    real_fsync, calls = os.fsync, []

    def interrupted(fd):
        calls.append(fd)
        if len(calls) == nth_fsync:
            raise KeyboardInterrupt
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        manager.save(trainer_payload(step=3), step=3)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert _steps(tmp_path) == [1, 2]            # nothing of step 3 committed, nothing deleted yet
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name], "the interrupted save left temp files"
    assert _manager(tmp_path).load_latest()["counters"]["global_step"] == 2


def test_retention_runs_after_the_commit_so_a_damaged_newest_checkpoint_falls_back(tmp_path):
    manager = _manager(tmp_path)
    for step in (1, 2, 3):
        manager.save(trainer_payload(step=step), step=step)
    assert _steps(tmp_path) == [2, 3]            # keep_last=2, applied after step 3 committed
    newest = reference.list_checkpoints(tmp_path)[-1].path
    shard = next(p for p in newest.iterdir() if p.name.startswith("model-"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = _manager(tmp_path).load_latest()
    assert loaded["counters"]["global_step"] == 2


def test_checkpoint_files_hold_no_numpy_pickles(tmp_path):
    """NumPy's RNG state is stored as a tensor: a pickle naming numpy._core (numpy 2) fails to load
    under numpy 1.26's weights_only allowlist, and numpy.core the other way (upgrade_resume)."""
    _manager(tmp_path).save(reference.capture(trainer_payload(step=1)["model"], global_step=1), step=1)
    pickles = [zipfile.ZipFile(p).read(name) for p in tmp_path.rglob("*.pt")
               for name in zipfile.ZipFile(p).namelist() if name.endswith("data.pkl")]
    assert pickles
    globals_named = {arg for data in pickles for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
    assert globals_named and not [g for g in globals_named if g.startswith("numpy")], globals_named


def _train(tmp_path: Path, total: int, log: str) -> dict[int, float]:
    cfg = RunConfig(tmp_path / "ckpt", total, 3, 0, tmp_path / log)
    cfg.ckpt_dir.mkdir(parents=True, exist_ok=True)
    assert ReferenceTrainer(cfg).run() == 0
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in cfg.loss_log.read_text().splitlines()}


def test_the_trainer_started_again_after_its_last_step_trains_nothing(tmp_path):
    _train(tmp_path, 12, "first.jsonl")
    assert _train(tmp_path, 12, "again.jsonl") == {}   # its newest checkpoint is step 12: nothing left to do


def test_the_trainer_extends_a_finished_run_onto_the_longer_runs_curve(tmp_path):
    _train(tmp_path / "a", 9, "first.jsonl")
    extended = _train(tmp_path / "a", 15, "more.jsonl")
    fresh = _train(tmp_path / "b", 15, "fresh.jsonl")
    assert sorted(extended) == list(range(10, 16))
    assert all(abs(extended[s] - fresh[s]) <= 1e-9 for s in extended)
