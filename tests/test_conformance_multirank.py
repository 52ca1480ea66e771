"""Multi-rank trainers: launched through torchrun, crash points per rank, per-rank curves, the
checks only jobs have, and a clear error for each way a multi-rank setup goes wrong."""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.crash import CrashPoint, parse_schedule
from conformance.process import RunSpec, rank_log, read_job_losses

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


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def test_torchrun_missing_is_one_usage_error(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    proc = subprocess.run([str(bin_dir / "python"), "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "conformance",
                           "--adapter=fixtures.ddp_trainer:ADAPTER", "--collect-only", "-q"],
                          cwd=tmp_path, env=_env(PATH=f"{bin_dir}:/usr/bin:/bin"), capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-3000:]
    assert "torchrun is not on PATH" in out and "Traceback" not in out


def test_a_rendezvous_port_in_use_is_one_usage_error(run_pytest):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_pytest("--pyargs", "conformance", "--adapter=fixtures.ddp_trainer:ADAPTER", f"--rdzv-port={port}",
                          "--collect-only")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-3000:]
    assert f"rendezvous port {port} on 127.0.0.1 is in use" in out


def test_more_ranks_than_cores_is_a_warning_not_an_error(run_pytest):
    ranks = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) + 2
    proc = run_pytest("--pyargs", "conformance", "--adapter=fixtures.ddp_trainer:ADAPTER", f"--world-size={ranks}",
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


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_reference_distributed_skips_a_damaged_checkpoint_on_every_rank(tmp_path):
    def job(total: int) -> subprocess.CompletedProcess:
        env = _env(CONFORMANCE_CKPT_DIR=str(tmp_path / "ckpt"), CONFORMANCE_TOTAL_STEPS=str(total),
                   CONFORMANCE_SAVE_EVERY="3", CONFORMANCE_SEED="0", CONFORMANCE_LOSS_LOG=str(tmp_path / "loss"),
                   OMP_NUM_THREADS="1")
        return subprocess.run(["torchrun", "--standalone", "--nproc-per-node=2", "-m", "fixtures.ddp_trainer"],
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


def test_bitflip_reaches_every_tensor_of_a_dcp_shard(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from conformance.corrupt import bitflip
    state = {"w": torch.ones(4, dtype=torch.float64), "b": torch.full((3,), 2.0), "n": torch.arange(3)}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    shard = next((tmp_path / "ck").glob("*.distcp"))
    assert "2 floating-point tensor record(s)" in bitflip(shard)
    loaded = {"w": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(3), "n": torch.zeros(3, dtype=torch.int64)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert loaded["w"][0] != 1.0 and loaded["b"][0] != 2.0 and loaded["w"][1] == 1.0
    assert loaded["n"].tolist() == [0, 1, 2]


def test_a_shifted_count_is_guessed_from_the_most_common_shift_of_its_own_syscall():
    from conformance.delivery import PlannedKill, ShiftGuesses

    class Run:   # stands in for a planned run: only its identity matters
        pass

    guesses, run, other = ShiftGuesses(), Run(), Run()
    assert [guesses.guess(run, "write", a) for a in (1, 2, 3, 4)] == [0, 1, 2, -1]   # nothing seen: 0, then small
    guesses.record(run, "write", 1)
    guesses.record(run, "write", None)          # a landing that could not tell
    assert guesses.guess(run, "write", 1) == 1 and guesses.guess(other, "write", 1) == 0
    assert guesses.guess(run, "mkdir", 1) == 0  # gloo's extra writes do not move another syscall's count
    guesses.record(run, "write", 0)
    guesses.record(run, "write", 0)
    assert guesses.guess(run, "write", 5) == 0
    # A shift never plans a count below the first call (strace rejects when=0: the rank would wait
    # for its tracer for ever).
    guesses.record(run, "mkdir", -1)
    first_mkdir = PlannedKill(CrashPoint("fs", 0, 1), "mkdir", 1, "rank 1: mkdir", 0, 0, 3)
    assert guesses.shifted(first_mkdir, run, 1).nth == 1
    assert guesses.shifted(dataclasses.replace(first_mkdir, nth=3), run, 1).nth == 2


def _run(ops):
    """A rank's recorded run made of `(kind, path, target, syscall, tid, killed)` operations."""
    from conformance.recording import Op, RecordedRun
    built = tuple(Op(i, kind, path, target=target, syscall=syscall, tid=tid, killed=killed, after_step=3)
                  for i, (kind, path, target, syscall, tid, killed) in enumerate(ops))
    return RecordedRun(RunSpec(14, 3, 0, 2), None, Path("/ck"), built, {}, frozenset())


def test_a_kill_on_a_path_every_run_shares_counts_only_its_threads_calls_on_that_path():
    from conformance.delivery import PlannedKill, path_delivery
    view = _run([("write", "s/rank1.pt", "", "write", 10, False),      # the main thread
                 ("write", "s/__1_0.distcp", "", "write", 11, False),  # a background writer
                 ("write", "s/rank1.pt", "", "write", 10, False),
                 ("write", "s/__1_0.distcp", "", "write", 11, False),
                 ("fsync", "s/__1_0.distcp", "", "fsync", 11, False),
                 ("unlink", "s/old", "", "unlinkat", 10, False),
                 ("write", "s/.tmp-83jd", "", "write", 10, False)])
    stable = frozenset({"s/rank1.pt", "s/__1_0.distcp", "s/old"})

    def at(k):
        return PlannedKill(CrashPoint("fs", k, 1), view.ops[k].syscall, 99, "", k, 0, 3)

    assert path_delivery(at(3), view, stable) == ("s/__1_0.distcp", 2)   # the writer's 2nd write to it
    assert path_delivery(at(4), view, stable) == ("s/__1_0.distcp", 1)   # its 1st fsync of it
    assert path_delivery(at(2), view, stable) == ("s/rank1.pt", 2)
    assert path_delivery(at(5), view, stable) is None    # unlinkat: -P does not resolve a dirfd-relative name
    assert path_delivery(at(6), view, stable) is None    # a run-random name: counted instead


def test_a_kill_by_path_landed_only_on_the_planned_call():
    from conformance.delivery import CrashNotLanded, PlannedKill, check_landed_on_path
    kill = PlannedKill(CrashPoint("fs", 3, 1), "write", 99, "rank 1: write", 3, 0, 3)
    first_write = _run([("write", "s/__1_0.distcp", "", "write", 11, True)])
    second_write = _run([("write", "s/__1_0.distcp", "", "write", 11, False),
                         ("write", "s/__1_0.distcp", "", "write", 11, True)])
    check_landed_on_path(kill, "s/__1_0.distcp", 2, second_write)
    with pytest.raises(CrashNotLanded, match=r"it hit write .* \(call #1 on it\)"):
        check_landed_on_path(kill, "s/__1_0.distcp", 2, first_write)
    with pytest.raises(CrashNotLanded, match="the rank was not reached"):
        check_landed_on_path(kill, "s/__1_0.distcp", 2, _run([("write", "s/__1_0.distcp", "", "write", 11, False)]))


def test_an_error_delivered_by_path_landed_on_the_planned_call():
    import dataclasses as dc

    from conformance.delivery import CrashNotLanded, PlannedKill, check_landed_on_path
    kill = PlannedKill(CrashPoint("fs", 4, 1), "fsync", 99, "rank 1: fsync", 4, 0, 3)
    run = _run([("fsync", "s/__1_0.distcp", "", "fsync", 11, False)])
    failed = dc.replace(run, ops=(dc.replace(run.ops[0], error="EIO"),))
    check_landed_on_path(kill, "s/__1_0.distcp", 1, failed)
    with pytest.raises(CrashNotLanded):
        check_landed_on_path(kill, "s/rank1.pt", 1, failed)   # the error hit another file


def test_a_count_shift_is_measured_at_the_last_loss_log_write_before_the_point():
    """gloo's wake-up writes can grow during a run (a group first used by an async save): the
    shift at step 1's log says nothing about a point in the save of step 3."""
    import dataclasses as dc

    from conformance.delivery import PlannedKill, count_shift
    from conformance.strace import Syscall

    def logs(counts):
        return {step: Syscall(step, 10, "write", n, (), "39") for step, n in counts.items()}

    planned = dc.replace(_run([("write", "s/.tmp-a", "", "write", 10, False)]), step_logs=logs({1: 1, 3: 10}))
    landed = dc.replace(_run([]), step_logs=logs({1: 1, 3: 12}))
    kill = PlannedKill(CrashPoint("fs", 0, 1), "write", 11, "rank 1: write", 0, 0, 3)
    assert count_shift(kill, planned, landed) == 2
    background = dc.replace(planned, ops=(dc.replace(planned.ops[0], tid=11),))
    assert count_shift(kill, background, landed) is None   # another thread's count: no anchor, nothing hit


def test_a_point_another_thread_reaches_by_count_is_not_delivered_by_count():
    from conformance.delivery import CrashPointMissing, PathDelivery, PlannedKill
    view = _run([("write", "s/.tmp-main", "", "write", 10, False),     # main thread: write #1 to a temp name
                 ("write", "s/__1_0.distcp", "", "write", 11, False)])  # background writer: its write #1
    view = dataclasses.replace(view, ops=tuple(dataclasses.replace(o, nth=1) for o in view.ops))

    def at(k):
        return PlannedKill(CrashPoint("fs", k, 1), "write", 1, "rank 1: write", k, 0, 3)

    with pytest.raises(CrashPointMissing, match="another thread of the rank makes its write #1 too"):
        PathDelivery(at(0), view, frozenset({"s/__1_0.distcp"}), Path("/ck"), job=True)
    assert not PathDelivery(at(1), view, frozenset({"s/__1_0.distcp"}), Path("/ck"), job=True).counting()
    assert PathDelivery(at(0), view, frozenset(), Path("/ck"), job=False).counting()   # one process: by count


def test_a_late_kill_shows_the_shift_at_the_planned_operation_itself():
    import dataclasses as dc

    from conformance.delivery import PlannedKill, count_shift
    planned = _run([("write", "s/a", "", "write", 10, False), ("write", "s/.tmp-b", "", "write", 10, False)])
    planned = dc.replace(planned, ops=tuple(dc.replace(o, nth=n) for o, n in zip(planned.ops, (5, 6))))
    landed = _run([("write", "s/a", "", "write", 10, False), ("write", "s/.tmp-c", "", "write", 10, False),
                   ("write", "s/d", "", "write", 10, True)])
    landed = dc.replace(landed, ops=tuple(dc.replace(o, nth=n) for o, n in zip(landed.ops, (3, 4, 6))))
    kill = PlannedKill(CrashPoint("fs", 1, 1), "write", 6, "rank 1: write", 1, 0, 3)
    assert count_shift(kill, planned, landed) == -2    # the target was this run's write #4, not #6


def test_a_job_fault_that_keeps_missing_by_a_few_calls_draws_another_point_but_a_divergence_fails():
    """gloo's wake-up writes can drift by more than the shifts catch up with: after the last
    attempt, a miss where the operations matched says nothing about the trainer (another point is
    drawn); operations that differ still fail it, and a single process gets no retry."""
    from conformance.delivery import (DELIVERY_ATTEMPTS, CrashNotLanded, CrashPointMissing, KillMissedCount,
                                      PlannedKill, deliver)
    kill = PlannedKill(CrashPoint("fs", 1, 1), "write", 6, "rank 1: write", 1, 0, 3)
    view = _run([("write", "s/a", "", "write", 10, False), ("write", "s/.tmp-b", "", "write", 10, False)])
    attempts = []

    def attempt(k):
        attempts.append(k.nth)
        return view

    def missing(k, landed):
        raise KillMissedCount("the killed run made 0 operation(s) before the kill, the planned run 1")

    def diverging(k, landed):
        raise CrashNotLanded("operation #0 differs")

    with pytest.raises(CrashPointMissing, match="deliveries by count missed"):
        deliver(kill, view, attempt, missing, job=True, shifted=True, reset=lambda: None)
    assert len(attempts) == DELIVERY_ATTEMPTS
    with pytest.raises(CrashNotLanded, match="differs") as raised:
        deliver(kill, view, attempt, diverging, job=True, shifted=True, reset=lambda: None)
    assert not isinstance(raised.value, CrashPointMissing)
    attempts.clear()
    with pytest.raises(KillMissedCount):
        deliver(kill, view, attempt, missing, job=False, shifted=False, reset=lambda: None)
    assert len(attempts) == 1
