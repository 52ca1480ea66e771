"""How far a job's per-thread syscall counts drift between attempts at one fault, learned from the
attempts themselves: the shift each one showed (`count_shift`) and the guess for the next (`SHIFTS`).

strace counts calls per thread, and a job's ranks make `write` calls whose number depends on
timing, so a fault planned by count on one run lands a few calls off in another. What the retries
by count learn is kept here, apart from delivery.py, which lands a fault and proves that it did:
a miss's shift is a fact about the job's timing, not about where the fault belongs."""
from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import TYPE_CHECKING

from ..trace import recording

if TYPE_CHECKING:
    from .delivery import PlannedKill  # the plan a shift moves (delivery imports this module)


def count_shift(kill: PlannedKill, planned: recording.RecordedRun, landed: recording.RecordedRun) -> int | None:
    """How many more calls of the kill's syscall a rank made in `landed` than in its planned run
    before the point, measured as near the point as the landed run allows; None if that cannot
    be told.

    A job's ranks make `write` calls whose number depends on timing (gloo wakes its I/O loop with
    a one-byte pipe write while it connects a process group, and in collectives), so a count
    planned on one run is off by a small amount in another, an amount that changes during the run.
    Nearest first: the planned operation itself, when the landed run went past it (a late kill);
    the operation the fault hit, when it came early; else the last loss-log write of the same
    thread before the point."""
    k = kill.mutations_before
    target = planned.ops[planned.mutations[k]] if not kill.point.at_step and k < len(planned.mutations) else None
    hit = landed.killed_op() or landed.failed_op() or landed.signalled_op()
    if target is not None and k < len(landed.mutations):
        same = landed.ops[landed.mutations[k]]
        if same.syscall == target.syscall and not (same.killed or same.error or same.signalled):
            return same.nth - target.nth          # the kill came later: the target's own count
    if hit is not None and hit.syscall == kill.syscall:
        if hit.kind == "log":
            same_log = planned.step_logs.get(hit.after_step + 1)   # the step it was logging
            if same_log is not None and same_log.name == hit.syscall:
                return hit.nth - same_log.nth
        else:
            done = [i for i in landed.mutations if i < hit.index]
            if len(done) < len(planned.mutations):
                same_op = planned.ops[planned.mutations[len(done)]]
                if same_op.syscall == hit.syscall:
                    return hit.nth - same_op.nth
    before = kill.point.index if kill.point.at_step else target.after_step if target else 0
    anchors = [s for s, sc in planned.step_logs.items()
               if s <= before and s in landed.step_logs and sc.name == kill.syscall == landed.step_logs[s].name
               and (target is None or sc.tid == target.tid)]
    if anchors:
        s = max(anchors)
        return landed.step_logs[s].nth - planned.step_logs[s].nth
    return None


class ShiftGuesses:
    """The shifts seen so far for each planned run and syscall (see count_shift), landed or not.
    Each run's own shift is drawn anew, so the best guess for the next attempt is the most common
    one; with none seen yet, 0 and then small shifts in turn. Only `write` counts drift (gloo's
    wake-ups); a shift seen in one syscall's count says nothing about another's."""

    FALLBACK = (0, 1, 2, -1, 3, -2, 4, -3)

    def __init__(self):
        self.seen: dict[tuple[int, str], tuple[weakref.ref, collections.Counter[int]]] = {}

    def _counts(self, run: recording.RecordedRun, syscall: str) -> collections.Counter[int] | None:
        found = self.seen.get((id(run), syscall))
        if found is None or found[0]() is not run:   # an id reused by a newer run
            return None
        return found[1]

    def record(self, run: recording.RecordedRun, syscall: str, shift: int | None) -> None:
        if shift is None:
            return
        counts = self._counts(run, syscall)
        if counts is None:
            counts = collections.Counter()
            self.seen[(id(run), syscall)] = (weakref.ref(run), counts)
        counts[shift] += 1

    def guess(self, run: recording.RecordedRun, syscall: str, attempt: int) -> int:
        counts = self._counts(run, syscall)
        if counts:
            return counts.most_common(1)[0][0]
        return self.FALLBACK[(attempt - 1) % len(self.FALLBACK)]

    def shifted(self, planned: PlannedKill, run: recording.RecordedRun, attempt: int, *,
                measured: int | None = None) -> PlannedKill:
        """`planned` with its count moved by `measured` (a shift just measured next to the point)
        or else by the guess for this attempt (never below the first call)."""
        nth = planned.nth + (measured if measured is not None else self.guess(run, planned.syscall, attempt))
        return dataclasses.replace(planned, nth=nth if nth >= 1 else planned.nth)


SHIFTS = ShiftGuesses()
