"""One trial: run a crash schedule against a trainer, with every kill checked to land exactly on
the operation it was planned at.

A kill is planned on a process's own uninterrupted run (the baseline for the first process; a
traced run on a copy of the directory for later ones) and delivered by strace at (syscall, nth).
The killed process is traced too, and aligned with its planned run (alignment.py): the kill
landed if the same operation was hit after the same operations, run-random names aside.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from . import alignment, recording, strace
from .adapters import TrainerAdapter
from .crash import CrashPoint, Schedule
from .process import ProcessResult, RunSpec
from .runners import Runner, traced_run


class CrashNotLanded(AssertionError):
    """The kill did not happen where it was planned: the trainer's filesystem operations are not
    a pure function of its inputs, or the injection was not delivered."""


class CrashPointMissing(Exception):
    """A later crash point of a schedule does not exist in its process (e.g. `step:2` for a process
    that resumed at step 9, or `fs:0` for one that writes nothing): the schedule does not apply."""


@dataclasses.dataclass(frozen=True)
class PlannedKill:
    """Where a crash point falls in a process's own uninterrupted run."""

    point: CrashPoint
    syscall: str
    nth: int
    text: str                   # what it interrupts, for messages
    mutations_before: int       # mutations under the checkpoint dir that happen before the kill
    newest_committed: int       # newest save finished before the kill
    in_progress: int | None     # the save the kill interrupts, if inside one


def plan(point: CrashPoint, run: recording.RecordedRun) -> PlannedKill | None:
    """The kill for `point` in a process whose uninterrupted run is `run`; None if it cannot be
    hit. `fs:i` counts targetable mutations and wraps around, so every drawn index names one."""
    if point.kind == "step":
        log = run.step_logs.get(point.index + 1)
        if log is None or not run.step_targetable(point.index + 1):
            return None
        before = sum(1 for i in run.mutations if run.ops[i].after_step <= point.index)
        return PlannedKill(point, log.name, log.nth, f"logging step {point.index + 1}", before,
                           run.committed_by_step(point.index), None)
    points = run.crash_points()
    if not points:
        return None
    k = points[point.index % len(points)]
    op = run.ops[run.mutations[k]]
    save = run.in_progress(op.index)
    where = f"{run.role(op.index)}: {op.describe()}"
    return PlannedKill(point, op.syscall, op.nth, where, k, run.committed_before(op.index), save)


@dataclasses.dataclass
class CrashedProcess:
    kill: PlannedKill
    result: ProcessResult
    started_from: int            # step this process resumed from (0 = fresh)
    resumed_from: int = -1       # step the *next* process resumed from (-1: it did not start)

    @property
    def point(self) -> CrashPoint:
        return self.kill.point


@dataclasses.dataclass
class TrialOutcome:
    spec: RunSpec
    schedule: Schedule
    crashed: list[CrashedProcess]
    final: ProcessResult

    def all_losses(self) -> list[tuple[str, dict[int, float]]]:
        """(which process, its logged losses) for every process that ran after a crash."""
        out = [(f"process {i + 2} (resumed after crash at {prev.point}, itself killed at {c.point})",
                c.result.losses) for i, (prev, c) in enumerate(zip(self.crashed, self.crashed[1:]))]
        out.append((f"process {len(self.crashed) + 1} (final, resumed after crash at "
                    f"{self.crashed[-1].point})" if self.crashed else "uninterrupted run", self.final.losses))
        return out

    @property
    def final_resumed_from(self) -> int:
        return self.crashed[-1].resumed_from if self.crashed else 0


def check_landed(kill: PlannedKill, planned: recording.RecordedRun, landed: recording.RecordedRun,
                 result: ProcessResult) -> None:
    """Raise CrashNotLanded unless the killed process died on the planned operation, having made
    the same operations before it as its planned run (run-random names aside)."""
    hit = landed.killed_op()
    if result.returncode not in (-9, 137) or hit is None:
        raise CrashNotLanded(
            f"crash point {kill.point} (planned: {kill.text}, {kill.syscall} #{kill.nth}) was not "
            f"delivered: the process exited {result.returncode} without being killed there")
    done = [i for i in landed.mutations if not landed.ops[i].killed]
    expected_hit = "log" if kill.point.kind == "step" else None
    lined_up = alignment.align(planned, landed, upto=min(len(done), kill.mutations_before))
    problem = None
    if lined_up.divergence is not None:
        problem = lined_up.divergence.describe("planned run", "killed run")
    elif len(done) != kill.mutations_before:
        problem = (f"the killed run made {len(done)} operation(s) under the checkpoint directory before "
                   f"the kill, the planned run {kill.mutations_before}")
    elif expected_hit == "log":
        if hit.kind != "log" or max(result.losses, default=0) != kill.point.index:
            problem = f"the kill hit {hit.describe()} after step {max(result.losses, default=0)} was logged"
    else:
        target = landed.mutations[kill.mutations_before] if kill.mutations_before < len(landed.mutations) else None
        if target is None or not landed.ops[target].killed:
            problem = f"the kill hit {hit.describe()}"
        else:
            check = alignment.align(planned, landed, upto=kill.mutations_before + 1)
            if check.divergence is not None:
                problem = check.divergence.describe("planned run", "killed run")
    if problem:
        raise CrashNotLanded(
            f"crash point {kill.point} was planned at {kill.text} but did not land there: {problem}. "
            "The trainer's filesystem operations differ between runs (threads racing, or names "
            "that are neither a function of the step nor fresh per run)")


def run_schedule(runner: Runner, adapter: TrainerAdapter, spec: RunSpec, schedule: Schedule, workdir: Path,
                 baseline: recording.RecordedRun) -> TrialOutcome:
    ckpt = (workdir / "ckpt").resolve()
    if ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)
    crashed: list[CrashedProcess] = []
    for i, point in enumerate(schedule):
        own = baseline if i == 0 else traced_run(runner, adapter, spec, workdir, tag=f"p{i}-trace", prepare=ckpt)
        started_from = 0 if i == 0 else own.result.resumed_from(spec)
        if crashed:
            crashed[-1].resumed_from = started_from
        kill = plan(point, own)
        if kill is None:
            what = (f"crash point {point} does not exist in process {i + 1}'s trace "
                    f"({len(own.crash_points())} targetable filesystem operations"
                    + (f", resumed from step {started_from})" if i else ")"))
            raise CrashPointMissing(what) if i else CrashNotLanded(what)
        log = (workdir / f"p{i}-loss.jsonl").resolve()
        trace_file = workdir / f"p{i}-inject.strace"
        before = frozenset(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*"))
        result = runner.run_process(adapter, spec, ckpt, log, prefix=strace.inject_argv(trace_file, kill.syscall, kill.nth),
                                    trace_file=trace_file)
        landed = recording.build(strace.parse(result.trace_text), spec, result, ckpt, log, preexisting=before)
        check_landed(kill, own, landed, result)
        result.killed, result.trace_text = True, ""
        crashed.append(CrashedProcess(kill, result, started_from))
    final_log = (workdir / "final-loss.jsonl").resolve()
    final = runner.run_process(adapter, spec, ckpt, final_log)
    if crashed:
        crashed[-1].resumed_from = final.resumed_from(spec)
    return TrialOutcome(spec, schedule, crashed, final)
