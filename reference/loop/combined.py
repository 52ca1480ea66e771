"""How save triggers combine: time OR event (`AnyOf`, `any_of`), the same with a minimum interval
between saves (`Hybrid`, `hybrid`), and no trigger at all (`forced_only`). A combined trigger reads
one clock once per decision for all its parts, and its state holds each part's state.

Why these rules are checked when a combined trigger is built, not when it decides: each part keeps its
own state (no trigger object twice), and a checkpoint has one "best" (at most one on_metric), so a
combination that breaks them could not be resumed to decide alike. The single triggers and the
protocol they share are `single`'s.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from .single import Clock, Decision, EverySeconds, OnMetric, Trigger, TriggerStateError, _num, _real, _state_number


class AnyOf(Trigger):
    """Save when any of the triggers fires (none: forced saves only); a save moves all of them on."""
    kind = "any_of"

    def __init__(self, *triggers: Trigger):
        super().__init__()
        self.triggers = _check_parts("any_of", triggers)
        self.clock = _shared_clock("any_of", self.triggers, None)

    def _decide(self, step, metrics, now):
        return _combine(tuple(t._decide(step, metrics, now) for t in self.triggers), step, now)

    def _state(self, d):
        parts = (None,) * len(self.triggers) if d is None else d.parts
        return {**self._head(d), "children": [t._state(p) for t, p in zip(self.triggers, parts)]}

    def _load(self, state, where):
        children = self._load_head(state, where, ("children",))["children"]
        if not isinstance(children, list) or len(children) != len(self.triggers):
            raise TriggerStateError(f"{where}: 'children' must be a list of {len(self.triggers)} states, "
                                    f"got {children!r}")
        for i, (t, s) in enumerate(zip(self.triggers, children)):
            t._load(s, f"{where}.children[{i}]")

    def describe(self):
        return f"any_of({', '.join(t.describe() for t in self.triggers)})" if self.triggers else "forced_only()"


class Hybrid(Trigger):
    """Save on time OR event, but never two saves closer than `min_interval_s` of clock time
    (a forced save excepted). A held-back event is not remembered: the next one is judged anew,
    a metric against the best value *saved*."""
    kind = "hybrid"

    def __init__(self, time_trigger_or_seconds: Trigger | float, event_trigger: Trigger, *,
                 min_interval_s: float = 0.0, clock: Clock | None = None):
        super().__init__()
        t = time_trigger_or_seconds
        if not isinstance(t, Trigger):
            t = EverySeconds(_real("hybrid: time_trigger_or_seconds (a Trigger, or seconds)", t, positive=True),
                             clock=time.time if clock is None else clock)
        self.triggers = _check_parts("hybrid", (t, event_trigger))
        self.time_trigger, self.event_trigger = self.triggers
        self.min_interval_s = _real("hybrid: min_interval_s", min_interval_s)
        self.clock = _shared_clock("hybrid", self.triggers, clock) or time.time
        self._last_time: float | None = None

    def _decide(self, step, metrics, now):
        d = _combine(tuple(t._decide(step, metrics, now) for t in self.triggers), step, now)
        if d.save and self._last_time is not None:
            elapsed = now - self._last_time
            if 0 <= elapsed < self.min_interval_s:
                d = dataclasses.replace(d, save=False, held=f"min_interval {_num(self.min_interval_s)}s: "
                                                            f"{_num(elapsed)}s since last save")
        return d

    def _state(self, d):
        time_part, event_part = (None, None) if d is None else d.parts
        return {**self._head(d), "last_saved_time": self._last_time if d is None else d.time,
                "time": self.time_trigger._state(time_part), "event": self.event_trigger._state(event_part)}

    def _load(self, state, where):
        state = self._load_head(state, where, ("last_saved_time", "time", "event"))
        self._last_time = _state_number(state, "last_saved_time", where)
        self.time_trigger._load(state["time"], f"{where}.time")
        self.event_trigger._load(state["event"], f"{where}.event")

    def describe(self):
        return (f"hybrid({self.time_trigger.describe()}, {self.event_trigger.describe()}, "
                f"min_interval={_num(self.min_interval_s)}s)")


# The names the combinations go by (describe() uses them): any_of(...), hybrid(...)
any_of, hybrid = AnyOf, Hybrid


def forced_only() -> AnyOf:
    """Never fires: only forced saves (a CheckpointManager given no cadence)."""
    return AnyOf()


# -- helpers ---------------------------------------------------------------------------------
def _combine(parts: tuple[Decision, ...], step: int, now: float | None) -> Decision:
    """Parts saving: their reasons. None saving: the reasons of the parts held back, and why."""
    saving = [p for p in parts if p.save]
    reasons = tuple(r for p in (saving or parts) for r in p.reasons)
    held = None if saving else next((p.held for p in parts if p.held), None)
    metric = next((p.metric for p in parts if p.metric is not None), None)   # at most one on_metric
    return Decision(bool(saving), reasons, any(p.best for p in parts), metric, step, now, held, parts)


def _check_parts(what: str, parts: tuple[Any, ...]) -> tuple[Trigger, ...]:
    """Each part keeps its own state, so no trigger object twice; a checkpoint has one "best",
    so at most one on_metric."""
    for i, p in enumerate(parts):
        if not isinstance(p, Trigger):
            raise ValueError(f"{what}: argument {i} must be a Trigger, got {p!r}")
    seen, stack = [], list(parts)
    while stack:
        t = stack.pop()
        if any(t is s for s in seen):
            raise ValueError(f"{what}: the trigger object {t!r} appears twice; give each part its own")
        seen.append(t)
        stack.extend(t.triggers)
    metrics = [t for t in seen if isinstance(t, OnMetric)]
    if len(metrics) > 1:
        raise ValueError(f"{what}: at most one on_metric per trigger (a checkpoint has one best), got {metrics!r}")
    return tuple(parts)


def _shared_clock(what: str, parts: tuple[Trigger, ...], clock: Clock | None) -> Clock | None:
    """The one clock a combined trigger reads, once per decision, for all its parts."""
    if clock is not None and not callable(clock):
        raise ValueError(f"{what}: clock must be a callable returning seconds, got {clock!r}")
    clocks = ([clock] if clock is not None else []) + [p.clock for p in parts if p.clock is not None]
    if any(c != clocks[0] for c in clocks[1:]):
        raise ValueError(f"{what}: its parts read different clocks ({', '.join(map(repr, clocks))}); use one")
    return clocks[0] if clocks else None
