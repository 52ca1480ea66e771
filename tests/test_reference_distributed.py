"""reference.distributed in one process (no process group: DCP saves and loads as one rank):
the commit protocol, async saves that count only once finished, verification with fallback and
retention; and one real 2-rank job under torchrun that skips a damaged checkpoint on every rank.
Its multi-rank behaviour is judged by the suite (fixtures/ddp_trainer.py and
fixtures/ddp_async_trainer.py in tests/test_conformance_gate.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from resume_conformance.reference import CheckpointSkippedWarning
from resume_conformance.reference.distributed import MANIFEST, DistributedCheckpointManager, committed_steps

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return model, opt


def _steps(directory) -> list[int]:
    return [s for s, _ in committed_steps(directory)]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_round_trips_model_optimizer_shared_and_rank_state(tmp_path, async_save):
    model, opt = _model(0)
    manager = DistributedCheckpointManager(tmp_path, async_save=async_save)
    manager.save(3, model, opt, shared={"global_step": 3}, rank_state={"pos": torch.tensor([7])})
    manager.wait()
    other, other_opt = _model(1)
    loaded = DistributedCheckpointManager(tmp_path).load_latest(other, other_opt)
    assert (loaded.step, loaded.shared["global_step"], loaded.rank_state["pos"].item()) == (3, 3, 7)
    assert torch.equal(other.weight, model.weight)
    assert other_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def test_an_async_save_is_not_committed_until_it_finished(tmp_path):
    model, opt = _model(0)
    manager = DistributedCheckpointManager(tmp_path, async_save=True)
    manager.save(3, model, opt)
    assert _steps(tmp_path) == []                    # written in the background: not "latest" yet
    assert not (tmp_path / "step-00000003").exists()
    assert manager.wait() == tmp_path / "step-00000003"
    assert _steps(tmp_path) == [3] and manager.wait() is None
    manager.save(6, model, opt)
    manager.save(9, model, opt)                      # waits for 6 first: at most one save in flight
    assert _steps(tmp_path) == [6, 3]
    manager.wait()
    assert _steps(tmp_path) == [9, 6]                # retention counts only committed saves


def test_load_latest_waits_for_a_pending_save(tmp_path):
    model, opt = _model(0)
    manager = DistributedCheckpointManager(tmp_path, async_save=True)
    manager.save(3, model, opt)
    assert manager.load_latest(*_model(1)).step == 3


def test_a_damaged_shard_is_skipped_for_the_previous_checkpoint(tmp_path):
    model, opt = _model(0)
    manager = DistributedCheckpointManager(tmp_path, keep_last=None)
    manager.save(3, model, opt)
    manager.save(6, model, opt)
    shard = next((tmp_path / "step-00000006").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = DistributedCheckpointManager(tmp_path).load_latest(*_model(1))
    assert loaded.step == 3
    assert any(issubclass(w.category, CheckpointSkippedWarning) and "sha256" in str(w.message) for w in caught)


def test_a_checkpoint_without_its_manifest_is_never_loaded(tmp_path):
    model, opt = _model(0)
    manager = DistributedCheckpointManager(tmp_path)
    manager.save(3, model, opt)
    (tmp_path / "step-00000003" / MANIFEST).unlink()
    with pytest.warns(CheckpointSkippedWarning, match="no manifest.json: never committed"):
        assert DistributedCheckpointManager(tmp_path).load_latest(*_model(1)) is None


@pytest.mark.slow
def test_reference_distributed_skips_a_damaged_checkpoint_on_every_rank(tmp_path):
    def job(total: int) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   CONFORMANCE_CKPT_DIR=str(tmp_path / "ckpt"), CONFORMANCE_TOTAL_STEPS=str(total),
                   CONFORMANCE_SAVE_EVERY="3", CONFORMANCE_SEED="0", CONFORMANCE_LOSS_LOG=str(tmp_path / "loss"),
                   OMP_NUM_THREADS="1")
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               f"--log-dir={tmp_path / 'torchrun'}", "-m", "resume_conformance.fixtures.ddp_trainer"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    first = job(10)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = tmp_path / "ckpt" / "step-00000009"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000006", "step-00000009"]
    damaged = bytearray((newest / "__1_0.distcp").read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (newest / "__1_0.distcp").write_bytes(bytes(damaged))
    again = job(12)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "rank 0: resumed from step 6" in again.stderr and "rank 1: resumed from step 6" in again.stderr
    assert "__1_0.distcp: size/sha256" in again.stderr   # the rank that found it says which file
