"""One trial: run a crash schedule against a trainer, with every kill checked to land exactly on
the operation it was planned at.

A kill is planned on a process's own uninterrupted run (the baseline for the first process; a
traced run on a copy of the directory for later ones) and delivered by strace at (syscall, nth).
The killed process is traced too, and aligned with its planned run (alignment.py): the kill
landed if the same operation was hit after the same operations, run-random names aside.

In a multi-rank job a point names a rank: the kill is planned on that rank's own run and only that
rank is traced; torchrun then stops the others. What "committed before the kill" means spans the
ranks: a save every rank finished before that moment. The other ranks run on until they notice
(at their next collective), so a save the killed rank had finished its part of may still be
committed after the kill: `newest_possible`. So may the save of the step a rank was killed logging,
when the killed rank writes nothing of it (`others_may_save`).

A node point (`@nodeK`, a job of several nodes) is planned and proven like a point of node K's
first rank, but that rank is frozen there instead of killed (strace skips the call and delivers
SIGSTOP: the rank runs nothing after it, and its agent sees no death to react to), and the runner
then takes node K down whole at once (run/nodes.py); the
other nodes get NODE_LOSS_GRACE_S to notice before the suite ends the job, as a scheduler would.
A trainer with node-local storage loses node K's directory too.
"""
from __future__ import annotations

import dataclasses
import shutil
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from ..model.adapters import TrainerAdapter
from ..model.crash import CrashPoint, Schedule
from ..model.process import DirectorySnapshot, ProcessResult, RunSpec, node_dir, rank_log, remove_logs
from ..run.runners import Runner, Stop, Tracing, traced_run
from ..trace import recording, saves
from .delivery import CrashNotLanded, CrashPointMissing, PlannedKill, choose_route, deliver  # noqa: F401  (re-exported for the checks)

# After a node is lost, how long the other nodes may run on before the suite stops the job.
NODE_LOSS_GRACE_S = 30.0
# A node point's rank: the call is not made (EINTR, never seen: the rank stops before it returns to
# user code), and the rank stops, for the runner to take its node down.
NODE_LOSS_ACTION = "error=EINTR:signal=STOP"


def plan(point: CrashPoint, run: recording.RecordedRun) -> PlannedKill | None:
    """The kill for `point` in a process (or a job) whose uninterrupted run is `run`; None if it
    cannot be hit. `save:s/tL/i` names an operation by its save and thread (saves.locate_point);
    `fs:i` names the rank's mutation i, or the first hittable one after it, wrapping around
    (RecordedRun.fs_target), so every drawn index names one."""
    try:
        view = run.rank_view(point.on_rank)
    except KeyError:
        return None
    who = f"rank {point.on_rank}: " if run.is_job else ""
    if point.at_step:
        log = view.step_logs.get(point.index + 1)
        if log is None or (point.index + 1) not in view.step_logs:
            return None
        before = sum(1 for i in view.mutations if view.ops[i].after_step <= point.index)
        own = view.committed_by_step(point.index)
        # In a job: committed by the time the rank logs, in the uninterrupted run's timing; a save
        # whose last operation was a background thread's is surely committed only by the step the
        # trainer waits for it (committed_by_step), so a kill before then may find it either way.
        newest = min(run.committed_at(log.ts), run.committed_by_step(point.index)) if run.is_job else own
        flying = view.in_flight_by_step(point.index)   # it may commit before the kill, or not
        return PlannedKill(point, log.name, log.nth, f"{who}logging step {point.index + 1}", before, newest, flying,
                           max(own, newest, flying or 0, others_may_save(run, point.on_rank, point.index + 1)))
    if point.kind in ("save", "retention"):
        k = saves.locate_point(view, point)
        if k is None:
            return None
    else:
        k = view.fs_target(point.index)
        if k is None:
            return None
    op = view.ops[view.mutations[k]]
    # Retention belongs to no save: the save around it, or one in flight on another thread, may
    # commit before the kill.
    save = view.in_progress(op.index) or (view.in_flight_by_step(op.after_step) if op.retention else None)
    own = view.committed_before(op.index)
    newest = run.committed_before(run.merged_index(op.rank, op.index)) if run.is_job else own
    where = f"{who}{view.role(op.index)}: {op.describe()}"
    return PlannedKill(point, op.syscall, op.nth, where, k, newest, save, max(own, newest, save or 0))


def others_may_save(run: recording.RecordedRun, rank: int, step: int) -> int:
    """In a job whose rank `rank` is killed as it logs step `step`: `step`, if that step has a
    save in which the killed rank writes nothing (replicated state that rank 0 alone writes),
    else 0. The killed rank had trained that step, so the others hold its whole state and may
    commit the save before they next wait for the killed rank."""
    if not run.is_job or step not in run.windows():
        return 0
    return 0 if step in run.rank_view(rank).windows() else step


def what_is_there(run: recording.RecordedRun, point: CrashPoint) -> str:
    """What the process's trace has where `point` looked, for the message that it is not there."""
    if point.on_rank not in (run.ranks or {0: 0}):
        return f"no rank {point.on_rank}"
    view = run.rank_view(point.on_rank)
    if point.kind == "retention":
        found = view.retention_ops(point.index, point.on_rank)
        if point.op <= len(found):
            return (f"operation {point.op} of the retention pass after the save of step {point.index} is "
                    f"{view.ops[found[point.op - 1]].describe()}, which a kill by count cannot hit exactly")
        return f"the retention pass after the save of step {point.index} has {len(found)} operation(s)"
    if point.kind != "save":
        return (f"{len(view.mutations)} filesystem operations under the checkpoint directory, "
                f"{len(view.crash_points())} of them hittable by a kill by count")
    lane = view.thread_ops(point.index, point.thread, point.on_rank)
    thread = f"background thread {point.thread}" if point.thread else "its logging thread"
    if point.op <= len(lane):
        return (f"operation {point.op} of the save of step {point.index} on {thread} is "
                f"{view.ops[lane[point.op - 1]].describe()}, which a kill by count cannot hit exactly")
    return f"the save of step {point.index} has {len(lane)} operation(s) on {thread}"


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


def run_schedule(runner: Runner, adapter: TrainerAdapter, spec: RunSpec, schedule: Schedule, workdir: Path,
                 baseline: recording.RecordedRun, stable: frozenset[str] = frozenset()) -> TrialOutcome:
    """Run `schedule`: each point kills one process (or one rank of a job), the next starts on
    what it left, and a last process runs to the end. `stable`: the relative paths that are the
    same in every run (see path_delivery)."""
    ckpt = (workdir / "ckpt").resolve()
    if ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)
    crashed: list[CrashedProcess] = []
    final_log = (workdir / "final-loss.jsonl").resolve()
    final_run: Future | None = None
    for i, point in enumerate(schedule):
        point = point.bound(spec.ranks_per_node)
        action = NODE_LOSS_ACTION if point.whole_node else "signal=KILL"
        stop = Stop(grace_s=NODE_LOSS_GRACE_S, signal="STOP", node=point.node) if point.whole_node else None
        own = baseline if i == 0 else traced_run(runner, adapter, spec, workdir, tag=f"p{i}-trace", prepare=ckpt)
        started_from = 0 if i == 0 else own.result.resumed_from(spec)
        if crashed:
            crashed[-1].resumed_from = started_from
        kill = plan(point, own)
        if kill is None:
            what = f"crash point {point} does not exist in process {i + 1}'s trace ({what_is_there(own, point)}" + (
                f", resumed from step {started_from})" if i else ")")
            raise CrashPointMissing(what) if i else CrashNotLanded(what)
        log = (workdir / f"p{i}-loss.jsonl").resolve()
        before = frozenset(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*"))
        snapshot = DirectorySnapshot(ckpt) if own.is_job else None
        own_view = own.rank_view(point.on_rank)
        # How the kill lands and is proven to (delivery.choose_route): a step point on the rank's
        # loss log; an fs point by path in a job or a threaded process where the path is the same
        # in every run, else (or once that missed) by count, shifted in a job (see deliver).
        route = choose_route(kill, own_view, stable, ckpt, rank_log(log, point.on_rank, spec.world_size),
                             job=own.is_job or own_view.threaded)
        runs: list[ProcessResult] = []
        # The last kill of a single process is delivered once (a miss raises, never retried), and
        # the final run needs nothing its landing check computes: the final run starts as soon as
        # the killed process is gone, and its trace is parsed and checked meanwhile.
        overlap = i == len(schedule) - 1 and not own.is_job

        def attempt(k: PlannedKill) -> recording.RecordedRun:
            nonlocal final_run
            tracing = Tracing.each(spec, workdir / f"p{i}-inject.strace", lambda f: route.argv(f, k, action),
                                   ranks=[point.on_rank])
            runs.append(runner.run_process(adapter, spec, ckpt, log, tracing=tracing, stop=stop))
            if overlap and final_run is None:
                pool = ThreadPoolExecutor(max_workers=1)
                final_run = pool.submit(runner.run_process, adapter, spec, ckpt, final_log)
                pool.shutdown(wait=False)
            return recording.from_result(runs[-1], spec, ckpt, log, preexisting=before).rank_view(point.on_rank)

        def check(k: PlannedKill, landed: recording.RecordedRun) -> None:
            route.check(k, own_view, landed, runs[-1], action)

        def reset() -> None:
            snapshot.restore()
            remove_logs(log, spec.world_size)

        try:
            kill = deliver(kill, own_view, attempt, check, job=own.is_job,
                           shifted=route.shifted(own.is_job), reset=reset, counting=route.counting)
        except BaseException:
            if final_run is not None:
                wait([final_run])   # the kill did not land: its final run is not used, but it is not left running
            raise
        result = runs[-1]
        if snapshot is not None:
            snapshot.drop()
        result.killed = True
        if point.whole_node and spec.node_local:
            shutil.rmtree(node_dir(ckpt, point.node), ignore_errors=True)   # its local disk is lost with it
        crashed.append(CrashedProcess(kill, result, started_from))
    final = final_run.result() if final_run is not None else runner.run_process(adapter, spec, ckpt, final_log)
    if crashed:
        crashed[-1].resumed_from = final.resumed_from(spec)
    return TrialOutcome(spec, schedule, crashed, final)
