"""Multi-rank trainers: launched through torchrun, crash points per rank, per-rank curves, the
checks only jobs have, and a clear error for each way a multi-rank setup goes wrong."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.model.crash import CrashPoint, parse_schedule
from conformance.model.process import RunSpec, rank_log, read_job_losses
from conformance.run import launch

REPO = Path(__file__).resolve().parent.parent

SINGLE_LOG = textwrap.dedent("""\
    import json, os
    # Ignores WORLD_SIZE: every rank appends to the one log.
    with open(os.environ["CONFORMANCE_LOSS_LOG"], "a") as log:
        for step in range(1, int(os.environ["CONFORMANCE_TOTAL_STEPS"]) + 1):
            log.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\\n")
""")


def test_crash_points_name_a_rank():
    assert parse_schedule("fs:9@r1,step:4@r0") == (CrashPoint("fs", 9, 1), CrashPoint("step", 4, 0))
    assert str(CrashPoint("fs", 9, 1)) == "fs:9@r1" and CrashPoint("step", 3).on_rank == 0
    with pytest.raises(ValueError, match="'@rN'"):
        CrashPoint.parse("fs:9@1")


def test_a_job_reads_one_log_per_rank_and_the_global_loss_is_their_mean(tmp_path):
    log = tmp_path / "loss.jsonl"
    rank_log(log, 0).write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 3.0}\n')
    rank_log(log, 1).write_text('{"step": 1, "loss": 2.0}\n')
    overall, ranks = read_job_losses(log, 2)
    assert overall == {1: 1.5} and ranks == ({1: 1.0, 2: 3.0}, {1: 2.0})
    assert rank_log(log, 0, 1) == log and RunSpec(4, 2, 0, 1, torchrun=True).is_job
    assert not RunSpec(4, 2, 0).is_job and RunSpec(4, 2, 0, 2).describe().endswith("world_size=2")


@pytest.mark.parametrize("runner_class", ["fresh.SubprocessRunner", "warm.WarmRunner"])
@pytest.mark.parametrize("nnodes", [1, 2])
def test_torchruns_logs_stay_in_the_runs_directory(tmp_path, runner_class, nnodes):
    """torchrun's agent makes a log directory per job; without --log-dir it is a new
    /tmp/torchelastic_* that nothing removes. The suite's are beside the job's stderr file."""
    import importlib

    from conformance.model.adapters import resolve
    module, _, name = runner_class.partition(".")
    adapter = resolve("resume_conformance.fixtures.ddp_trainer:ADAPTER", None, world_size=2 * nnodes, nnodes=nnodes)
    runner = getattr(importlib.import_module(f"conformance.run.{module}"), name)()
    (tmp_path / "ckpt").mkdir()
    log = tmp_path / "loss.jsonl"
    try:
        result = runner.run_process(adapter, RunSpec(2, 1, 0, 2 * nnodes, nnodes=nnodes), tmp_path / "ckpt", log)
    finally:
        runner.close()
    assert result.returncode == 0, result.stderr[-3000:]
    logs = launch.log_dir(log.with_name(log.name + ".stderr"))
    agents = sorted(p.name for p in logs.iterdir())
    assert len(agents) == nnodes and all((logs / a / "attempt_0").is_dir() for a in agents), agents


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def test_torchrun_is_this_interpreters_module_so_no_torchrun_on_path_is_needed(tmp_path):
    # This interpreter itself, with a PATH that has no torchrun (an environment that is not
    # activated): the job is launched as `python -m torch.distributed.run` and collects.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "conformance",
                           "--adapter=resume_conformance.fixtures.ddp_trainer:ADAPTER", "--collect-only", "-q"],
                          cwd=tmp_path, env=_env(PATH=f"{bin_dir}:/usr/bin:/bin"), capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "usage error" not in out and "Traceback" not in out, out[-3000:]
    assert launch.fresh_argv(("python", "-m", "t"), RunSpec(14, 3, 0, 2), 1234, logs=tmp_path)[:3] == [sys.executable, "-m",
                                                                                  "torch.distributed.run"]


def test_a_torch_without_distributed_is_one_usage_error(monkeypatch):
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(launch.LaunchError, match="cannot import torch.distributed.run"):
        launch.torchrun_program()


def test_a_rendezvous_port_in_use_is_one_usage_error(run_pytest):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_pytest("--pyargs", "conformance", "--adapter=resume_conformance.fixtures.ddp_trainer:ADAPTER",
                          f"--rdzv-port={port}",
                          "--collect-only")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-3000:]
    assert f"rendezvous port {port} on 127.0.0.1 is in use" in out


def test_more_ranks_than_cores_is_a_warning_not_an_error(run_pytest):
    ranks = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) + 2
    proc = run_pytest("--pyargs", "conformance", "--adapter=resume_conformance.fixtures.ddp_trainer:ADAPTER",
                      f"--world-size={ranks}",
                      "--collect-only")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"world size {ranks} is larger than the" in out and "the ranks share cores" in out


@pytest.mark.slow
@pytest.mark.needs_strace
def test_a_trainer_that_ignores_world_size_and_writes_one_log_is_told_so(tmp_path, run_pytest):
    (tmp_path / "single_log.py").write_text(SINGLE_LOG)
    proc = run_pytest("--pyargs", "conformance", f"--trainer-cmd={sys.executable} single_log.py", "--world-size=2",
                      "-k", "determinism")
    assert "1 failed" in proc.stdout, proc.stdout[-3000:]
    assert "a 2-rank run left no loss log for rank(s)" in proc.stdout, proc.stdout[-3000:]


def test_bitflip_reaches_every_tensor_of_a_dcp_shard(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from conformance.faults.corrupt import bitflip
    state = {"w": torch.ones(4, dtype=torch.float64), "b": torch.full((3,), 2.0), "n": torch.arange(3)}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    shard = next((tmp_path / "ck").glob("*.distcp"))
    assert "2 floating-point tensor record(s)" in bitflip(shard)
    loaded = {"w": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(3), "n": torch.zeros(3, dtype=torch.int64)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert loaded["w"][0] != 1.0 and loaded["b"][0] != 2.0 and loaded["w"][1] == 1.0
    assert loaded["n"].tolist() == [0, 1, 2]
