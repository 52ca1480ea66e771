"""Whether a measured ratio meets its target: judged on the spread of per-round ratios, so that
one noisy sample (another process's burst of I/O) can neither pass nor fail a gate."""
from __future__ import annotations

import dataclasses
import statistics

from .constants import MIN_ROUNDS, MIN_SAMPLE_S


@dataclasses.dataclass(frozen=True)
class RatioJudgement:
    """One ratio: the median of its per-round values, their interquartile range (the spread) and
    full range, and the verdict against its target: "met" only when the whole spread is on the
    right side of it, "missed" when the whole spread is on the wrong side, else "inconclusive"."""

    median: float
    spread: tuple[float, float]     # 25th and 75th percentile of the per-round ratios
    range: tuple[float, float]
    target: str                     # e.g. ">= 0.9"
    verdict: str                    # met | missed | inconclusive
    why: str = ""                   # for an inconclusive verdict

    def as_json(self) -> dict:
        return {"target": self.target, "verdict": self.verdict, "met": self.verdict == "met",
                "median": self.median, "spread": list(self.spread), "range": list(self.range),
                **({"why": self.why} if self.why else {})}


def per_round(numerator: list[float], denominator: list[float]) -> list[float]:
    """Round r's ratio numerator[r] / denominator[r]: the two ran side by side in that round."""
    return [a / b for a, b in zip(numerator, denominator) if b > 0]


def judge(values: list[float], op: str, bound: float, *, shortest_median_s: float | None = None) -> RatioJudgement:
    """Judge `values` (per-round ratios, or one value for an untimed measure) against `op bound`."""
    if not values:
        raise ValueError("no values to judge")
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    med = statistics.median(ordered)
    good_lo = q1 >= bound if op == ">=" else q3 <= bound      # the whole spread on the right side
    bad_all = q3 < bound if op == ">=" else q1 > bound        # the whole spread on the wrong side
    why = ""
    if shortest_median_s is not None and len(ordered) < MIN_ROUNDS:
        why = f"{len(ordered)} rounds (at least {MIN_ROUNDS} are needed to judge)"
    elif shortest_median_s is not None and shortest_median_s < MIN_SAMPLE_S:
        why = (f"a sample takes {shortest_median_s:.2f} s (at least {MIN_SAMPLE_S} s is needed: "
               "use a larger --size-mb)")
    verdict = "inconclusive" if why else "met" if good_lo else "missed" if bad_all else "inconclusive"
    if verdict == "inconclusive" and not why:
        why = f"the spread {q1:.3f}..{q3:.3f} crosses the target {bound}"
    return RatioJudgement(round(med, 4), (round(q1, 4), round(q3, 4)), (round(ordered[0], 4), round(ordered[-1], 4)),
                          f"{op} {bound}", verdict, why)
