"""How close a resumed loss curve must come to the uninterrupted one, learned from the trainer.

A trainer whose two uninterrupted runs are bitwise equal has no noise for a resume to hide behind:
every resume must then be bitwise equal too. A trainer with run-to-run noise ε (threads racing in a
reduction, a nondeterministic kernel) gets NOISE_MULTIPLE x ε, and never more than --loss-tol,
which is a cap, not the comparison. The one place that decides the number a comparison uses.
"""
from __future__ import annotations

import dataclasses

# A resume runs the same kernels as an uninterrupted run, for fewer steps after a load: its distance
# from the baseline is the same kind of noise, measured once on a single pair of runs. Ten times that
# pair leaves room for a pair that happened to agree more closely than most.
NOISE_MULTIPLE = 10.0

EXACT_CAUSES = ("state kept at lower precision in the checkpoint than in training (fp16 or bf16 weights, "
                "an optimizer moment cast down)", "a piece of state not restored (a buffer, an EMA, an RNG draw "
                "made between the restore and the first step)")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """The largest |diff| a comparison allows, and where that number came from."""

    value: float
    noise: float | None      # the largest |diff| between two uninterrupted runs; None: not measured
    cap: float               # --loss-tol
    reason: str = ""         # why a check keeps the cap whatever the noise (a resume on another world size)
    digests: tuple[str, ...] = ()   # state components compared too (digests.comparable: equal in both runs)

    @property
    def exact(self) -> bool:
        return self.value == 0.0

    def allows(self, got: float, expected: float | None) -> bool:
        """Whether `got` is close enough to `expected` (a missing or NaN value never is)."""
        return expected is not None and abs(got - expected) <= self.value

    def describe(self) -> str:
        digests = f"; state digests compared: {', '.join(self.digests)}" if self.digests else ""
        return self._losses() + digests

    def _losses(self) -> str:
        if self.reason:
            return f"{self.value:g}, the --loss-tol cap ({self.reason})"
        if self.exact:
            return "0 (exact: the trainer's two uninterrupted runs are bitwise equal)"
        if self.noise is None:
            return f"{self.value:g}, the --loss-tol cap (the trainer's run-to-run noise was not measured)"
        return (f"{self.value:g} ({NOISE_MULTIPLE:g} x the trainer's run-to-run noise {self.noise:.3g}"
                + (f", capped at --loss-tol {self.cap:g})" if self.value == self.cap else ")"))

    def verdict_line(self) -> str:
        """The line a loss mismatch's failure gets: what an exact trainer's difference means."""
        if not self.exact:
            return f"    tolerance {self.describe()}"
        return ("    exact trainer, inexact resume: its uninterrupted runs are bitwise equal, so any difference "
                "is a defect, however small; likely causes: " + "; or ".join(EXACT_CAUSES))


def learned(noise: float | None, cap: float, digests: tuple[str, ...] = ()) -> Tolerance:
    """The tolerance for a trainer whose uninterrupted runs differ by at most `noise` in loss, and
    agree on the state digests `digests`."""
    if noise is None:
        return Tolerance(cap, None, cap, digests=digests)
    if noise == 0.0:
        return Tolerance(0.0, 0.0, cap, digests=digests)
    return Tolerance(min(cap, NOISE_MULTIPLE * noise), noise, cap, digests=digests)


def capped(cap: float, reason: str) -> Tolerance:
    """A comparison that keeps the cap, and says why (the learned noise does not describe it)."""
    return Tolerance(cap, None, cap, reason)


def limit(tol: float | Tolerance) -> float:
    return tol.value if isinstance(tol, Tolerance) else tol
