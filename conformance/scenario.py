"""One trial: run a crash schedule against a trainer, then judge it.

The judgments are pure functions of the recorded outcome, so a failing trial's verdict can be
recomputed (and replayed) from the schedule alone.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

from .adapters import TrainerAdapter
from .crash import CrashPoint, Schedule
from .tracing import Event
from .trials import Baseline, ProcessResult, RunSpec, injection_for, traced_run
from .tracing import killed_at, strace_prefix


class CrashNotLanded(AssertionError):
    """The kill did not happen where it was planned: the trainer's filesystem operations are not
    a pure function of its inputs, or the injection was not delivered."""


class CrashPointMissing(Exception):
    """A later crash point of a schedule does not exist in its process (e.g. `step:2` for a process
    that resumed at step 9, or `fs:0` for one that writes nothing): the schedule does not apply."""


@dataclasses.dataclass
class CrashedProcess:
    point: CrashPoint
    planned: Event
    planned_text: str
    result: ProcessResult
    started_from: int            # step of the checkpoint this process resumed from (0 = fresh)
    newest_committed: int        # newest save finished before the kill, by this process's trace
    in_progress: int | None      # the save the kill interrupted, if it was inside one


@dataclasses.dataclass
class TrialOutcome:
    spec: RunSpec
    schedule: Schedule
    crashed: list[CrashedProcess]
    final: ProcessResult
    resume_points: list[int]     # resume point of the process after each crash

    def all_losses(self) -> list[tuple[str, dict[int, float]]]:
        """(which process, its logged losses) for every process that ran after a crash."""
        out = [(f"process {i + 2} (resumed after crash at {prev.point}, itself killed at {c.point})",
                c.result.losses) for i, (prev, c) in enumerate(zip(self.crashed, self.crashed[1:]))]
        out.append((f"process {len(self.crashed) + 1} (final, resumed after crash at "
                    f"{self.crashed[-1].point})" if self.crashed else "uninterrupted run", self.final.losses))
        return out


def _shape(path: str, root: Path) -> str:
    """A path with the parts that legitimately differ between runs masked: the run's root, hex
    and digits (pids, tokens, steps) and `tempfile`'s random names (`tmpXXXXXXXX`, `.tmpXXXXXX`)."""
    rel = path[len(str(root)):] if path.startswith(str(root)) else path
    rel = re.sub(r"tmp[A-Za-z0-9_]{6,8}(?=$|/)", "tmp*", rel)
    return re.sub(r"[0-9a-f]{6,}|\d+", "#", rel)


def _window_of(baseline: Baseline, event_index: int) -> tuple[int, list[int]]:
    for step, idxs in baseline.save_windows().items():
        if event_index in idxs:
            return step, idxs
    return 0, []


def resume_point(result: ProcessResult, spec: RunSpec) -> int:
    if result.first_step is not None:
        return result.first_step - 1
    return spec.total_steps if result.returncode == 0 else -1


def run_schedule(runner, adapter: TrainerAdapter, spec: RunSpec, schedule: Schedule, workdir: Path,
                 baseline: Baseline) -> TrialOutcome:
    ckpt = (workdir / "ckpt").resolve()
    if ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)
    crashed: list[CrashedProcess] = []
    for i, point in enumerate(schedule):
        own = baseline if i == 0 else traced_run(runner, adapter, spec, workdir, tag=f"p{i}-trace", prepare=ckpt)
        started_from = 0 if i == 0 else resume_point(own.result, spec)
        found = injection_for(point, own)
        if found is None:
            what = (f"crash point {point} does not exist in process {i + 1}'s trace "
                    f"({len(own.crash_points())} targetable filesystem operations"
                    + (f", resumed from step {started_from})" if i else ")"))
            raise CrashPointMissing(what) if i else CrashNotLanded(what)
        inject, planned = found
        log = (workdir / f"p{i}-loss.jsonl").resolve()
        trace_file = workdir / f"p{i}-inject.strace"
        result = runner.run_process(adapter, spec, ckpt, log, prefix=strace_prefix(trace_file, inject=inject),
                                    trace_file=trace_file)
        landed = killed_at(result.trace_text, inject[0])
        planned_text = planned.describe(own.ckpt_dir) if point.kind == "fs" else f"logging step {point.index + 1}"
        if result.returncode not in (-9, 137) or landed is None:
            raise CrashNotLanded(
                f"crash point {point} (planned: {planned_text}, {inject[0]} #{inject[1]}) was not "
                f"delivered: the process exited {result.returncode} without being killed there")
        expected = [str(log)] if point.kind == "step" else [_shape(p, own.ckpt_dir) for p in planned.paths]
        actual = list(landed) if point.kind == "step" else [_shape(p, ckpt) for p in landed]
        if actual != expected:
            raise CrashNotLanded(f"crash point {point} was planned at {planned_text} but landed at "
                                 f"{inject[0]} {list(landed)}: the trainer's filesystem operations differ "
                                 "between runs (threads racing, or names that are not a function of the step)")
        result.killed = True
        if point.kind == "fs":
            kill_index = own.events.index(planned)
            step, _ = _window_of(own, kill_index)
            finished = [s for s, idxs in own.save_windows().items()
                        if s and idxs and max(idxs) < kill_index]
            in_progress = step or None
        else:
            finished = [s for s, idxs in own.save_windows().items() if s and idxs and s <= point.index]
            in_progress = None
        newest = max(finished + [started_from])
        crashed.append(CrashedProcess(point, planned, planned_text, result, started_from, newest, in_progress))
    final_log = (workdir / "final-loss.jsonl").resolve()
    final = runner.run_process(adapter, spec, ckpt, final_log)
    resume_points = [c.started_from for c in crashed[1:]] + [resume_point(final, spec)]
    return TrialOutcome(spec, schedule, crashed, final, resume_points)
