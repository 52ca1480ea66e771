"""State digests: which components of the trainer's state a resume changed, step by step.

A trainer may log, with each step's loss, a digest of each component of its state (model,
optimizer, scheduler, rng, data, anything else such as an EMA). Where it does, a resume is compared
with the uninterrupted run component by component: an EMA that was never saved, or an optimizer
moment cast down, shows there before it moves the loss (or where it never does). Which components
are comparable is learned from the two uninterrupted runs (a component that differs between them
is not deterministic, and is left out); the tolerance carries that set (tolerance.Tolerance).
"""
from __future__ import annotations

import dataclasses

from ..model.process import Curve


@dataclasses.dataclass(frozen=True)
class StateMismatch:
    """The first step at which a resumed run's state digests leave the uninterrupted run's."""

    step: int
    differs: tuple[str, ...]        # components whose digest differs at that step
    equal: tuple[str, ...]          # compared components that are still equal there
    at_setup: bool = False          # found in the resumed process's state before its first step

    def describe(self) -> str:
        what = " and ".join(self.differs)
        same = f"; {', '.join(self.equal)} equal" if self.equal else ""
        if self.at_setup:
            return (f"{what} state differs right after the resumed process's set-up, before it trains step "
                    f"{self.step + 1} (compared with the uninterrupted run's after step {self.step}){same}")
        return f"{what} state differs after resume at step {self.step}{same}"


def comparable(first: dict, second: dict) -> tuple[str, ...]:
    """Components that two uninterrupted runs (their Curves) both log at every common step, with
    the same digest at each: the ones a resume can be held to."""
    a, b = getattr(first, "states", {}), getattr(second, "states", {})
    steps = sorted(set(a) & set(b))
    if not steps:
        return ()
    names = set.intersection(*(set(a[s]) & set(b[s]) for s in steps))
    return tuple(sorted(n for n in names if all(a[s][n] == b[s][n] for s in steps)))


def first_state_mismatch(baseline: dict, resumed: dict, components: tuple[str, ...]) -> StateMismatch | None:
    """The first resumed step whose digests differ from the baseline's, among `components`; None
    when they agree (or either curve logs none)."""
    base, got = getattr(baseline, "states", {}), getattr(resumed, "states", {})
    if not components or not base:
        return None
    restored = getattr(resumed, "restored", None)
    if restored is not None and restored[0] in base:   # the state a resume starts from: before any step
        k, digests = restored
        names = [n for n in components if n in base[k] and n in digests]
        differs = tuple(n for n in names if base[k][n] != digests[n])
        if differs:
            return StateMismatch(k, differs, tuple(n for n in names if n not in differs), at_setup=True)
        if names:
            # The restore is proven exact. What training does after it is the losses' to judge: a
            # job of more than two ranks sums its gradients in another order on the first steps after
            # any start (DDP rebuilds its buckets), so its weights may differ in the last bit while
            # every loss stays bitwise equal (measured: 4 ranks on 2 nodes, resume_conformance.fixtures.ddp_trainer).
            return None
    for step in sorted(set(base) & set(got)):
        names = [n for n in components if n in base[step] and n in got[step]]
        differs = tuple(n for n in names if base[step][n] != got[step][n])
        if differs:
            return StateMismatch(step, differs, tuple(n for n in names if n not in differs))
    return None


def has_states(curve: dict) -> bool:
    return isinstance(curve, Curve) and bool(curve.states)
