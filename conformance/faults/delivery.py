"""Delivering a planned fault exactly where it was planned, and proving that it landed there.

A fault (a KILL, an injected errno, a SIGTERM) is planned on a process's own uninterrupted run as
(syscall, nth): strace's `inject=SYSCALL:ACTION:when=N` counts calls per thread. A single
process is faulted by count. In a multi-rank job, counts drift (gloo's wake-up writes) and a
background writer's calls race the main thread's to the same count, so a job's fault goes by path
where it can (strace -P on a path every run shares, counting only the calls on it), and otherwise
by count, shifted by what earlier attempts showed (shifts.py) and retried on a restored directory.
Either way the faulted run is traced and the landing checked before anything is judged.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..model.crash import CrashPoint
from ..model.process import ProcessResult
from ..trace import alignment, recording, strace
from .shifts import SHIFTS, count_shift


class CrashNotLanded(AssertionError):
    """The kill did not happen where it was planned: the trainer's filesystem operations are not
    a pure function of its inputs, or the injection was not delivered."""


class KillMissedCount(CrashNotLanded):
    """The fault came before or after the planned operation (or never, the count running past the
    process's last call), the operations before it the same: the count it was delivered by was off
    (a job's `write` counts drift), not the trainer."""


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
    mutations_before: int       # mutations under the checkpoint dir that happen before the kill (its rank's)
    newest_committed: int       # newest save finished (by every rank) before the kill
    in_progress: int | None     # the save the kill interrupts, if inside one
    newest_possible: int = 0    # newest save that can be committed once the kill has happened

    def allowed_resumes(self) -> set[int]:
        """Steps the next start may rightly resume from: the newest committed save, the one the
        kill interrupted (if the trainer can tell it is complete), and in a job any save the killed
        rank had finished its part of (the others may commit it after the kill)."""
        lo, hi = self.newest_committed, max(self.newest_possible, self.newest_committed)
        return {lo, hi} | ({self.in_progress} if self.in_progress else set())


def check_landed(kill: PlannedKill, planned: recording.RecordedRun, landed: recording.RecordedRun,
                 result: ProcessResult) -> None:
    """Raise CrashNotLanded unless the killed process died on the planned operation, having made
    the same operations before it as its planned run (run-random names aside). For a job,
    `planned` and `landed` are the killed rank's own runs (the job itself exits non-zero)."""
    hit = landed.killed_op()
    if (result.returncode not in (-9, 137) and not result.rank_losses) or hit is None:
        raise KillMissedCount(
            f"crash point {kill.point} (planned: {kill.text}, {kill.syscall} #{kill.nth}) was not "
            f"delivered: the process exited {result.returncode} without being killed there")
    done = [i for i in landed.mutations if not landed.ops[i].killed]
    expected_hit = "log" if kill.point.at_step else None
    lined_up = alignment.align(planned, landed, upto=min(len(done), kill.mutations_before))
    problem, missed = None, False
    if lined_up.divergence is not None:
        problem = lined_up.divergence.describe("planned run", "killed run")
    elif len(done) != kill.mutations_before:
        problem, missed = (f"the killed run made {len(done)} operation(s) under the checkpoint directory before "
                           f"the kill, the planned run {kill.mutations_before}"), True
    elif expected_hit == "log":
        if hit.kind != "log" or max(landed.losses, default=0) != kill.point.index:
            problem, missed = f"the kill hit {hit.describe()} after step {max(landed.losses, default=0)} was logged", True
    else:
        target = landed.mutations[kill.mutations_before] if kill.mutations_before < len(landed.mutations) else None
        if target is None or not landed.ops[target].killed:
            problem, missed = f"the kill hit {hit.describe()}", True
        else:
            check = alignment.align(planned, landed, upto=kill.mutations_before + 1)
            if check.divergence is not None:
                problem = check.divergence.describe("planned run", "killed run")
    if problem:
        raise (KillMissedCount if missed else CrashNotLanded)(
            f"crash point {kill.point} was planned at {kill.text} but did not land there: {problem}. "
            "The trainer's filesystem operations differ between runs (threads racing, or names "
            "that are neither a function of the step nor fresh per run)")


# A job's kill is delivered at most this often (see shifts.count_shift).
DELIVERY_ATTEMPTS = 8


def check_landed_on_log(kill: PlannedKill, landed: recording.RecordedRun) -> None:
    """For a fault delivered by path (a job's step point, strace -P on the rank's loss log): the
    rank was killed (or signalled) at the write that logs the step after the planned one."""
    hit = landed.killed_op() or landed.signalled_op()
    if hit is None or hit.kind != "log" or hit.after_step != kill.point.index:
        raise CrashNotLanded(f"fault at {kill.point} was planned at {kill.text} but did not land there: "
                             + ("the rank was not reached" if hit is None else
                                f"it hit {hit.describe()} after step {hit.after_step} was logged"))


def deliver(planned: PlannedKill, own_view: recording.RecordedRun, attempt, check, *, job: bool, shifted: bool,
            reset, counting=lambda: True) -> PlannedKill:
    """Deliver a planned fault: `attempt(kill)` runs one faulted process (or job) and returns the
    faulted rank's recorded run; `check(kill, landed)` raises CrashNotLanded unless it landed.
    In a job, a miss is retried after `reset()` (at most DELIVERY_ATTEMPTS times), with the count
    shifted when `shifted`: by the shift the missed attempt showed next to the point, else by the
    most common one seen (shifts.py). `counting()` says whether the next attempt delivers by
    count at all (not by path): only those teach shifts.
    Returns the kill that landed."""
    kill = SHIFTS.shifted(planned, own_view, 1) if shifted else planned
    for n in range(1, DELIVERY_ATTEMPTS + 1):
        by_count = shifted and counting()
        landed = attempt(kill)
        try:
            check(kill, landed)
        except CrashNotLanded as exc:
            if job and by_count and n == DELIVERY_ATTEMPTS and isinstance(exc, KillMissedCount):
                # Same operations, fault off by a few calls each time: the job's counts drift more
                # than the shifts caught up with. That says nothing about the trainer.
                raise CrashPointMissing(f"{DELIVERY_ATTEMPTS} deliveries by count missed by a few calls each, "
                                        f"the job's write counts drifting; the last: {exc}") from exc
            if not job or n == DELIVERY_ATTEMPTS:
                raise
            measured = count_shift(kill, own_view, landed) if by_count else None
            SHIFTS.record(own_view, kill.syscall, measured)
            if shifted:
                # This attempt's own shift, measured next to the point, beats the run's usual one.
                kill = SHIFTS.shifted(planned, own_view, n + 1, measured=measured)
            reset()
            continue
        if by_count:
            SHIFTS.record(own_view, kill.syscall, kill.nth - planned.nth)
        return kill
    raise AssertionError("unreachable: the last attempt returns or raises")


# Syscalls strace -P matches by the path of their fd or of their path argument; the *at calls
# (unlinkat from shutil.rmtree, ...) may name a file relative to a directory fd, which -P does not
# resolve. A path delivery that still misses falls back to counting (run_schedule).
PATH_SYSCALLS = frozenset({"write", "pwrite64", "writev", "pwritev", "pwritev2", "fsync", "fdatasync", "ftruncate",
                           "mkdir", "rename", "unlink", "rmdir", "truncate"})


def path_delivery(kill: PlannedKill, view: recording.RecordedRun, stable: frozenset[str]) -> tuple[str, int] | None:
    """For a job's `fs` kill: (the relative path, the count) that deliver it with strace -P,
    counting only this thread's calls of the syscall on that path, or None when its path is not
    the same in every run (`stable`: paths two uninterrupted runs share) or the kill is a step's.

    Counting by path is exact whatever other threads do (a background writer's calls would
    otherwise race the main thread's to the same count) and whatever gloo writes."""
    if kill.point.at_step:
        return None
    op = view.ops[view.mutations[kill.mutations_before]]
    if op.syscall not in PATH_SYSCALLS or not op.inside or op.path not in stable or (op.target and op.target not in stable):
        return None
    nth = sum(1 for o in view.ops[:op.index + 1]
              if o.tid == op.tid and o.syscall == op.syscall and op.path in (o.path, o.target))
    return op.path, nth


def check_landed_on_path(kill: PlannedKill, path: str, nth: int, landed: recording.RecordedRun) -> None:
    """For a fault delivered by path: the rank died in (or got its error or signal from) its
    `nth` call of the syscall on `path`."""
    hit = landed.killed_op() or landed.failed_op() or landed.signalled_op()
    before = [] if hit is None else [o for o in landed.ops[:hit.index]
                                     if o.tid == hit.tid and o.syscall == hit.syscall and path in (o.path, o.target)]
    if hit is None or hit.syscall != kill.syscall or path not in (hit.path, hit.target) or len(before) != nth - 1:
        raise CrashNotLanded(f"crash point {kill.point} was planned at {kill.text} but did not land there: "
                             + ("the rank was not reached" if hit is None else
                                f"it hit {hit.describe()} (call #{len(before) + 1} on it)"))


def count_ambiguous(kill: PlannedKill, view: recording.RecordedRun) -> bool:
    """Whether another thread of the rank makes the same count of the kill's syscall, by any call
    (the main thread's loss-log writes too): strace counts per thread, so a fault by count could
    land in either, whichever gets there first in that run (a background writer's calls race the
    main thread's)."""
    if kill.point.at_step:
        return False
    op = view.ops[view.mutations[kill.mutations_before]]
    return (op.syscall, op.nth) in view.shared_counts or any(
        o.tid != op.tid and o.syscall == op.syscall and o.nth == op.nth for o in view.ops)


class Route:
    """One way of landing a fault, and the proof that it landed: the one place a fault's delivery
    is chosen (`choose_route`). Kills, storage errors and SIGTERMs all go through one."""

    def counting(self) -> bool:
        """Whether the next attempt goes by count (only those teach shifts, see deliver)."""
        return False

    def shifted(self, job: bool) -> bool:
        """Whether a count this route delivers by is shifted and retried (see deliver): in a job,
        whose `write` counts drift, for a point at an operation; never on the loss log."""
        return False

    def argv(self, trace_file: Path, kill: PlannedKill, action: str = "signal=KILL", *, data: bool = False) -> list[str]:
        raise NotImplementedError

    def check(self, kill: PlannedKill, planned: recording.RecordedRun, landed: recording.RecordedRun,
              result: ProcessResult, action: str = "signal=KILL") -> None:
        """Raise CrashNotLanded (KillMissedCount for a miss by count) unless it landed."""
        raise NotImplementedError


@dataclasses.dataclass
class OnLog(Route):
    """A step point: the rank's nth write to its own loss log (strace -P), exact whatever else the
    process writes or how its threads race (no count of other calls is involved)."""

    path: str
    nth: int

    def argv(self, trace_file, kill, action="signal=KILL", *, data=False):
        return strace.inject_on_path_argv(trace_file, kill.syscall, self.nth, self.path, action=action)

    def check(self, kill, planned, landed, result, action="signal=KILL"):
        check_landed_on_log(kill, landed)


class AtOperation(Route):
    """An `fs` point (or a step point that needs the whole recording): by path (strace -P, see
    path_delivery) in a job or a threaded process while its path is the same in every run and has
    not missed, else by count. A point that can go by count only, where another thread reaches
    the same count, is not deliverable (CrashPointMissing: another point is drawn)."""

    def __init__(self, kill: PlannedKill, view: recording.RecordedRun, stable: frozenset[str], ckpt: Path, *,
                 job: bool):
        self.target = path_delivery(kill, view, stable) if job else None
        self.ckpt = ckpt
        if job and self.target is None and count_ambiguous(kill, view):
            raise CrashPointMissing(f"{kill.point} ({kill.text}) cannot be hit exactly: its path differs from run "
                                    f"to run, and another thread of the rank makes its {kill.syscall} "
                                    f"#{kill.nth} too")

    def counting(self) -> bool:
        return self.target is None

    def shifted(self, job: bool) -> bool:
        return job

    def by_count(self) -> None:
        """Go by count from now on (a path delivery traces the faulted rank's calls on that path
        only; a run whose directory is rebuilt from what it did needs all of them)."""
        self.target = None

    def argv(self, trace_file, kill, action="signal=KILL", *, data=False):
        if self.target is None:
            return strace.inject_argv(trace_file, kill.syscall, kill.nth, action=action, data=data)
        where, count = self.target
        return strace.inject_on_path_argv(trace_file, kill.syscall, count, str(self.ckpt / where), action=action)

    def check(self, kill, planned, landed, result, action="signal=KILL"):
        if self.target is None:
            if action == "signal=KILL":
                check_landed(kill, planned, landed, result)
            else:
                check_fault_landed(kill, planned, landed, error=action.startswith("error="))
            return
        try:
            check_landed_on_path(kill, *self.target, landed)
        except CrashNotLanded:
            self.target = None     # the next attempts count calls instead
            raise


def choose_route(kill: PlannedKill, view: recording.RecordedRun, stable: frozenset[str], ckpt: Path, rank_log: Path,
                 *, job: bool, whole_recording: bool = False) -> Route:
    """How a fault at `kill` lands in the process (or job rank) whose own run is `view`: a step point
    on its loss log, unless the faulted run must be recorded whole (`whole_recording`); an `fs`
    point at its operation (`job`: a job, or a process whose calls come from several threads)."""
    if kill.point.at_step and not whole_recording:
        return OnLog(str(rank_log), view.log_writes_until(kill.point.index + 1))
    return AtOperation(kill, view, stable, ckpt, job=job)


def check_fault_landed(kill: PlannedKill, planned: recording.RecordedRun, landed: recording.RecordedRun, *,
                       error: bool) -> None:
    """For a storage error or a signal delivered by count: raise CrashNotLanded unless it hit the
    planned operation after the same operations (a step point: the same operations before it)."""
    k = kill.mutations_before
    if kill.point.at_step:
        lined_up = alignment.align(planned, landed, upto=k)
        if lined_up.divergence is not None:
            raise CrashNotLanded(f"fault at {kill.point} did not land at {kill.text}: "
                                 + lined_up.divergence.describe("planned run", "faulted run"))
        return
    hit_at = landed.failed_op() if error else landed.signalled_op()
    if hit_at is not None:
        before = sum(1 for i in landed.mutations if i < hit_at.index)
        if not (hit_at.mutation and before == k) and alignment.align(planned, landed, upto=min(before, k)).divergence is None:
            # The same operations up to where the fault hit, and it hit another call (a loss-log
            # write, another write of the save): the count was off, not the trainer. What the
            # trainer did after that fault differs from the plan because of it.
            raise KillMissedCount(f"fault at {kill.point} (planned: {kill.text}) hit "
                                  + ("its loss log" if hit_at.kind == "log" else f"{landed.role(hit_at.index)}: "
                                     f"{hit_at.describe()}") + " instead, after the same operations")
    if k >= len(landed.mutations):
        raise KillMissedCount(f"fault at {kill.point} (planned: {kill.text}) was not delivered: the faulted process "
                              f"made only {len(landed.mutations)} operations")
    hit = landed.ops[landed.mutations[k]]
    lined_up = alignment.align(planned, landed, upto=k + 1)
    if lined_up.divergence is not None or (error and not hit.error):
        why = lined_up.divergence.describe("planned run", "faulted run") if lined_up.divergence else \
            f"operation #{k} did not fail ({hit.describe()})"
        raise (CrashNotLanded if lined_up.divergence else KillMissedCount)(
            f"fault at {kill.point} did not land at {kill.text}: {why}")
