"""Faults other than a kill, delivered at an operation of a recorded run: a storage error
(strace `error=ENOSPC|EDQUOT|EIO`) or a scheduler's SIGTERM (strace `signal=TERM`, then SIGKILL
after a grace period), followed by a fresh start on the same directory.

Points are planned exactly like kills (scenario.plan) and, like kills, proven to land: the faulted
process is traced and aligned with its planned run.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from ..model.adapters import TrainerAdapter
from ..model.crash import CrashPoint
from ..model.process import ProcessResult, RunSpec, rank_log, remove_logs
from ..offline.crash_states import Replayer
from ..run.runners import Runner, Stop, Tracing
from ..trace import recording, strace
from .delivery import CrashNotLanded, CrashPointMissing, PlannedKill, choose_route, deliver
from .scenario import plan, what_is_there


class StateNotRebuilt(CrashPointMissing):
    """The directory a case needs cannot be rebuilt offline (recording.UnreplayableTrace: a file whose
    bytes the trace does not hold, from a source that changed since the run was recorded): the case
    is left out, counted as an undelivered draw, and says nothing of the trainer."""


ERRNOS = {"enospc": "ENOSPC", "edquot": "EDQUOT", "eio": "EIO"}
# Syscalls an error can be injected into: the writes, syncs and namespace changes of a save.
ERROR_SYSCALLS = frozenset({"write", "pwrite64", "writev", "pwritev", "pwritev2", "fsync", "fdatasync",
                            "rename", "renameat", "renameat2", "mkdir", "mkdirat"})


@dataclasses.dataclass
class FaultOutcome:
    spec: RunSpec
    point: CrashPoint
    action: str                      # "error=ENOSPC", "signal=TERM"
    planned: PlannedKill
    first: ProcessResult             # the faulted process
    first_run: recording.RecordedRun  # what it did (paths only)
    final: ProcessResult             # the next start, run to the end (without then_start: the faulted one)
    log: Path | None = None          # the faulted process's loss log

    @property
    def resumed_from(self) -> int:
        return self.final.resumed_from(self.spec)


def error_points(run: recording.RecordedRun) -> list[int]:
    """Ordinals (the `fs:i` numbering) of the crash points an error can be injected into:
    writes, syncs and namespace changes inside a save (`run`: one process, or one rank's own run)."""
    points = run.crash_points()
    return [n for n, k in enumerate(points) if run.ops[run.mutations[k]].syscall in ERROR_SYSCALLS
            and run.ops[run.mutations[k]].save]


def run_fault(runner: Runner, adapter: TrainerAdapter, spec: RunSpec, point: CrashPoint, action: str,
              workdir: Path, baseline: recording.RecordedRun, *, stop: Stop | None = None,
              went_on_past: int | None = None, stable: frozenset[str] = frozenset(),
              faulted_spec: RunSpec | None = None, then_start: bool = True) -> FaultOutcome:
    """Fault one process at `point` with `action`, then start the trainer again on what it left.

    With `went_on_past`=s (the step of the faulted save), the faulted process is recorded with its
    data, and if it goes on training (exit 0) the next start runs on the directory as it was right
    before the process began its next save (rebuilt offline from that recording: exact, where
    stopping the process from outside would race it), not as the whole run left it: whatever the
    trainer did about the failed save (a retry, in the foreground or in flight) is in it, and
    nothing a later save wrote. `stable`: paths the same in every run (a job's
    fault on one is delivered by path, as a kill is; delivery.choose_route). `faulted_spec`: the
    same run with other hints in its environment (CONFORMANCE_HANG_TIMEOUT), or another launch
    (torchrun's --max-restarts), for the faulted process only. Without `then_start`, nothing is
    started after the faulted process (a job torchrun restarts in place finishes by itself)."""
    ckpt = (workdir / "ckpt").resolve()
    if ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)
    if point.whole_node:
        raise CrashPointMissing(f"{point} loses a whole node: node points are for crash schedules (rank_resume, "
                                "all_or_nothing); this check faults one rank, written '@rN'")
    kill = plan(point, baseline)
    if kill is None:
        raise CrashNotLanded(f"fault point {point} does not exist in the trainer's trace ({what_is_there(baseline, point)})")
    log = (workdir / "faulted-loss.jsonl").resolve()
    rank = point.on_rank
    data = went_on_past is not None
    own_view = baseline.rank_view(rank)
    # How the fault lands and is proven to (delivery.choose_route), as kills do: a step point on
    # the rank's loss log, unless the directory may have to be rebuilt from what the faulted
    # process did (then it is recorded whole, by count); an fs point by path in a job or a threaded
    # process where its path is the same in every run. A signal or an error, unlike a kill, lets the
    # process go on: by count it would also hit any other thread that reaches the same count later
    # (strace counts per thread), so a threaded process goes by path too.
    route = choose_route(kill, own_view, stable, ckpt, rank_log(log, rank, spec.world_size),
                         job=baseline.is_job or own_view.threaded, whole_recording=data)

    def argv_for(f: Path, k: PlannedKill) -> list[str]:
        # The faulted rank gets the fault; the others of a job are recorded (with their data, if
        # the directory may have to be rebuilt from what they did).
        if f.name.endswith(f".rank{rank}") or spec.world_size == 1:
            return route.argv(f, k, action, data=data)
        return strace.record_argv(f, data=data)

    runs: list[tuple[ProcessResult, recording.RecordedRun]] = []

    def attempt(k: PlannedKill) -> recording.RecordedRun:
        tracing = Tracing.each(spec, workdir / "faulted.strace", lambda f: argv_for(f, k))
        result = runner.run_process(adapter, faulted_spec or spec, ckpt, log, tracing=tracing, stop=stop)
        runs.append((result, recording.from_result(result, spec, ckpt, log)))
        for f in tracing.files():
            f.unlink(missing_ok=True)
        return runs[-1][1].rank_view(rank)

    def reset() -> None:
        shutil.rmtree(ckpt)
        ckpt.mkdir(parents=True)
        remove_logs(log, spec.world_size)

    def check(k: PlannedKill, landed: recording.RecordedRun) -> None:
        route.check(k, own_view, landed, runs[-1][0], action)

    planned = kill
    kill = deliver(planned, own_view, attempt, check, job=baseline.is_job, shifted=route.shifted(baseline.is_job),
                   reset=reset, counting=route.counting)
    if data and not route.counting() and runs[-1][0].returncode == 0:
        route.by_count()
        reset()
        kill = deliver(planned, own_view, attempt, check, job=True, shifted=True, reset=reset,
                       counting=route.counting)
    first, first_run = runs[-1]
    if went_on_past is not None and first.returncode == 0:
        rebuild_before_next_save(first_run, went_on_past, ckpt)
    final = runner.run_process(adapter, spec, ckpt, (workdir / "final-loss.jsonl").resolve()) if then_start else first
    return FaultOutcome(spec, point, action, kill, first, first_run, final, log)


def rebuild_before_next_save(run: recording.RecordedRun, save: int, ckpt: Path) -> None:
    """The directory a faulted process that went on left right before it began the save after
    `save`, rebuilt at `ckpt` from its recording (with its data); StateNotRebuilt when it cannot be
    (a file copied in from outside the trace changed since, a write the recording cut short)."""
    replayer = Replayer()
    for op in run.ops:
        if op.save > save:
            break
        replayer.apply(op)
    why = run.unreplayable or replayer.problem()
    if why:
        raise StateNotRebuilt(f"the faulted process went on, and the directory it left before its next save cannot "
                              f"be rebuilt from its recording: {why}")
    if ckpt.exists():
        shutil.rmtree(ckpt)
    replayer.materialize(ckpt)


def committed_after_failed_sync(run: recording.RecordedRun) -> str | None:
    """fsyncgate: the failed fsync's file renamed into place afterwards, without being written
    anew (after a failed fsync the kernel may have dropped its dirty pages, and a retried fsync
    "succeeds" with the data gone). Returns what happened, or None."""
    failed = run.failed_op()
    if failed is None or failed.kind != "fsync":
        return None
    path = failed.path
    for op in run.ops[failed.index + 1:]:
        if op.kind == "create" and op.path == path and ("O_TRUNC" in op.flags or "O_CREAT" in op.flags):
            return None   # written anew
        if op.kind == "rename" and op.path == path:
            return (f"`{path}` was renamed to `{op.target}` after its fsync failed"
                    + (" (a retried fsync succeeded, but after a failed fsync the data may already be gone)"
                       if any(o.kind == "fsync" and o.path == path and not o.error
                              for o in run.ops[failed.index + 1:op.index]) else ""))
    return None
