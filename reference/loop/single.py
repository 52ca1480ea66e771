"""One save trigger and the protocol every trigger follows: every N steps (`EverySteps`), every T
seconds (`EverySeconds`), when a metric improves (`OnMetric`), each deciding why it saves (`Decision`)
and recording its state so a resume decides alike. How triggers combine is `combined`'s; the public
names are `triggers`'.

`decide` is pure; only `committed`, called once the save it asked for is committed, moves the state
on (last saved step and time, best metric value saved): a failed save changes nothing. `record` is
what the checkpoint stores: why, and the state as of after that save, which a resumed run loads to
make exactly the decisions the uninterrupted run makes.

Time is wall time (`time.time`) by default, not monotonic: "last saved at" must mean the same after
a restart, in another process or on another machine. A clock that reads earlier than the last save
(set back, or a machine whose clock is behind) counts as the interval having passed: waiting for it
to catch up could mean hours without a checkpoint.

The helpers below (`_real`, `_num`, `_state_number`) are the protocol's: how a trigger checks an
argument, writes a number in its reasons and reads one from its state. `combined` uses them too, so
a combined trigger says and checks things exactly as its parts do.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

Clock = Callable[[], float]


class TriggerStateError(ValueError):
    """A trigger state that cannot be loaded: another kind of trigger's, another metric's, or
    malformed. Loading it anyway would make the resumed run decide differently."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether to save at `step`, and why. `reasons`: what fired ("forced" first when forced);
    `held`: why it fired but does not save (min_interval, step already saved). `best`: this save
    holds the best metric value saved so far. `time`: the clock reading the decision was made at,
    which `committed` records as the save time (None: the trigger never reads the clock).
    `parts`: the decisions of a combined trigger's parts, which `committed` needs."""
    save: bool
    reasons: tuple[str, ...]
    best: bool
    metric: float | None
    step: int
    time: float | None
    held: str | None = None
    parts: tuple[Decision, ...] = dataclasses.field(default=(), repr=False)


class Trigger:
    """Base class. A subclass gives `_decide(step, metrics, now)` (pure, given the clock reading),
    `_state(decision)` (the state once that save is committed; with None, the state now),
    `_load(state, where)` (raising TriggerStateError) and `describe`."""
    kind: ClassVar[str]
    clock: Clock | None = None          # None: this trigger never reads the clock
    triggers: tuple[Trigger, ...] = ()   # a combined trigger's parts

    def __init__(self) -> None:
        self._last_step: int | None = None

    def decide(self, step: int, metrics: Mapping[str, float] | None = None, *, force: bool = False) -> Decision:
        """Whether to save at `step`. Changes nothing. `force` (the SIGTERM path) always saves,
        past every rule; otherwise a step already saved is not saved again."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        metrics = {} if metrics is None else metrics
        if not isinstance(metrics, Mapping):
            raise ValueError(f"metrics must be a mapping of name to value, got {metrics!r}")
        now = None if self.clock is None else float(self.clock())
        d = self._decide(int(step), metrics, now)
        if force:
            return dataclasses.replace(d, save=True, reasons=("forced",) + d.reasons, held=None)
        if d.save and step == self._last_step:
            d = dataclasses.replace(d, save=False, held=f"step {step} already saved")
        return dataclasses.replace(d, best=d.best and d.save)

    def committed(self, decision: Decision) -> None:
        """Call once the save `decision` asked for is committed. A save that failed: don't."""
        self._load(self._state(_saving(decision)), self.kind)

    def record(self, decision: Decision) -> dict[str, Any]:
        """What the checkpoint saved for `decision` stores: why, and this trigger's state as of
        after that save (plain JSON), which a resumed run passes to `load_state_dict`."""
        d = _saving(decision)
        metric = d.metric if d.metric is not None and math.isfinite(d.metric) else None
        return {"trigger": self.describe(), "reasons": list(d.reasons), "best": d.best,
                "metric": metric, "step": d.step, "time": d.time, "state": self._state(d)}

    def state_dict(self) -> dict[str, Any]:
        return self._state(None)

    def describe(self) -> str:
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()` (or a record's "state"); all or nothing."""
        before = self.state_dict()
        try:
            self._load(state, self.kind)
        except BaseException:
            self._load(before, self.kind)
            raise

    def __repr__(self) -> str:
        return self.describe()

    def _head(self, d: Decision | None) -> dict[str, Any]:
        return {"kind": self.kind, "last_saved_step": self._last_step if d is None else d.step}

    def _load_head(self, state: Any, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
        """Check the kind and the exact keys, and set the last saved step."""
        if not isinstance(state, Mapping):
            raise TriggerStateError(f"{where}: a trigger state must be a dict, got {state!r}")
        if state.get("kind") != self.kind:
            raise TriggerStateError(f"{where}: the state is from a {state.get('kind')!r} trigger, "
                                    f"not {self.kind!r} ({self.describe()})")
        expected = {"kind", "last_saved_step", *keys}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected, key=str)
            raise TriggerStateError(f"{where}: malformed state, missing keys {missing}, unexpected keys {extra}")
        step = state["last_saved_step"]
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise TriggerStateError(f"{where}: 'last_saved_step' must be a non-negative integer or null, got {step!r}")
        self._last_step = step
        return state


class EverySteps(Trigger):
    """Save when step % n == 0 (steps count from 0; step 0 is never saved unless forced)."""
    kind = "every_steps"

    def __init__(self, n: int):
        super().__init__()
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"every_steps: n must be an integer >= 1, got {n!r}")
        self.n = int(n)

    def _decide(self, step, metrics, now):
        fire = step > 0 and step % self.n == 0
        return Decision(fire, (f"every_steps({self.n})",) if fire else (), False, None, step, now)

    def _state(self, d):
        return self._head(d)

    def _load(self, state, where):
        self._load_head(state, where, ())

    def describe(self):
        return f"every_steps({self.n})"


class EverySeconds(Trigger):
    """Save when `seconds` have passed since the last save (any save, whatever its reason), or
    since this trigger was created if nothing was saved yet. Both times are in the state."""
    kind = "every_seconds"

    def __init__(self, seconds: float, *, clock: Clock = time.time):
        super().__init__()
        self.seconds = _real("every_seconds: seconds", seconds, positive=True)
        if not callable(clock):
            raise ValueError(f"every_seconds: clock must be a callable returning seconds, got {clock!r}")
        self.clock = clock
        self._started = float(clock())
        self._last_time: float | None = None

    def _decide(self, step, metrics, now):
        last = self._last_time
        elapsed = now - (self._started if last is None else last)
        if 0 <= elapsed < self.seconds:
            return Decision(False, (), False, None, step, now)
        since = "start" if last is None else "last save"
        why = (f"{_num(elapsed)}s since {since}" if elapsed >= 0
               else f"the clock reads {_num(-elapsed)}s before the {since}")
        return Decision(True, (f"{self.describe()}: {why}",), False, None, step, now)

    def _state(self, d):
        last_time = self._last_time if d is None else d.time
        return {**self._head(d), "started_at": self._started, "last_saved_time": last_time}

    def _load(self, state, where):
        state = self._load_head(state, where, ("started_at", "last_saved_time"))
        self._started = _state_number(state, "started_at", where, optional=False)
        self._last_time = _state_number(state, "last_saved_time", where)

    def describe(self):
        return f"every_seconds({_num(self.seconds)})"


class OnMetric(Trigger):
    """Save when metric `name` is better than the best value saved so far by more than
    `min_delta` (the first value always counts). An absent metric decides nothing; NaN or an
    infinity never improves. A save for any reason whose value beats the best saved value at all
    becomes the new best (`Decision.best`), so improvements are measured against what is on disk."""
    kind = "on_metric"

    def __init__(self, name: str, mode: str = "min", min_delta: float = 0.0):
        super().__init__()
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"on_metric: name must be a non-empty string, got {name!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"on_metric: mode must be 'min' or 'max', got {mode!r}")
        self.name, self.mode = name, mode
        self.min_delta = _real("on_metric: min_delta", min_delta)
        self._best: float | None = None

    def _decide(self, step, metrics, now):
        raw = metrics.get(self.name)
        if raw is None:
            return Decision(False, (), False, None, step, now)
        value = _metric_value(self.name, raw)
        if not math.isfinite(value):
            return Decision(False, (), False, value, step, now)
        best = self._best
        if best is None:
            return Decision(True, (f"metric:{self.name} first value {_num(value)}",), True, value, step, now)
        gain = best - value if self.mode == "min" else value - best
        fire = gain > self.min_delta
        reasons = (f"metric:{self.name} improved {_num(best)} -> {_num(value)}",) if fire else ()
        return Decision(fire, reasons, gain > 0, value, step, now)

    def _state(self, d):
        best = d.metric if d is not None and d.best else self._best
        return {**self._head(d), "name": self.name, "mode": self.mode, "best": best}

    def _load(self, state, where):
        state = self._load_head(state, where, ("name", "mode", "best"))
        if (state["name"], state["mode"]) != (self.name, self.mode):
            raise TriggerStateError(f"{where}: the state is for metric {state['name']!r} ({state['mode']}), "
                                    f"not {self.name!r} ({self.mode}): its best value means nothing here")
        self._best = _state_number(state, "best", where)

    def describe(self):
        delta = f", min_delta={_num(self.min_delta)}" if self.min_delta else ""
        return f"on_metric({self.name!r}, {self.mode}{delta})"


# The names the triggers go by (describe() uses them): every_steps(100), on_metric("val_loss"), ...
every_steps, every_seconds, on_metric = EverySteps, EverySeconds, OnMetric


# -- helpers ---------------------------------------------------------------------------------
def _saving(decision: Any) -> Decision:
    if not isinstance(decision, Decision) or not decision.save:
        raise ValueError(f"committed() and record() take a decide() Decision to save, got {decision!r}")
    return decision


def _real(what: str, value: Any, *, positive: bool = False) -> float:
    bad = isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
    if bad or (value <= 0 if positive else value < 0):
        raise ValueError(f"{what} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _metric_value(name: str, raw: Any) -> float:
    if not isinstance(raw, bool):
        with contextlib.suppress(TypeError, ValueError):
            return float(raw)            # a Python or NumPy number, a one-element tensor
    raise ValueError(f"metrics[{name!r}] must be a real number, got {raw!r}")


def _state_number(state: Mapping[str, Any], key: str, where: str, optional: bool = True) -> float | None:
    v = state[key]
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TriggerStateError(f"{where}: {key!r} must be a finite number{' or null' * optional}, got {v!r}")
    return float(v)


def _num(x: float) -> str:
    """7200.0 -> "7200", 0.47 -> "0.47": short, and exact (repr) when not integral."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else repr(float(x))
