"""How noisy a trainer's uninterrupted runs are: whether two of them agree, in losses and in
filesystem operations, by how much they differ, and the tolerance that noise earns every later
comparison (determinism_precondition's facts, measured once per run shape by session.py).

Kept apart from session.py, which runs the trainer and caches its runs: what the differences
between two recorded runs mean (noise, a dependence on the process it runs in, a job's reduction
order) is judged from the recordings alone, in one place, whichever check asks."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..model import evidence
from ..model.process import RunSpec
from ..trace import alignment
from ..trace.recording import RecordedRun
from . import digests
from .failures import format_mismatches, loss_mismatches, max_abs_diff
from .tolerance import Tolerance, learned

# Two uninterrupted runs of a job start alike, so they agree bit for bit; a resumed job of more than
# two ranks sums its gradients in another order on its first steps (DDP rebuilds its buckets after the
# first backward), and a + b + c differs from a + c + b in the last bit (measured with the bundled DDP
# trainer as 4 ranks on 2 nodes: docs/running.md). Two ranks add in one order.
MANY_RANKS = ("a job of more than two ranks reduces its gradients in another order after any restart, so its "
              "resumes need not be bitwise equal even where its uninterrupted runs are")


@dataclasses.dataclass(frozen=True)
class Determinism:
    """Whether two uninterrupted runs agree, in losses and in filesystem operations."""

    losses_problem: str | None
    operations_problem: str | None
    alignment: alignment.Alignment
    evidence: evidence.Determinism
    tolerance: Tolerance        # learned from the two runs' largest |diff|


def measure(spec: RunSpec, base: RecordedRun, again: RecordedRun, cap: float, *, traced: bool,
            warm_again_agrees: Callable[[], bool]) -> Determinism:
    """What two uninterrupted runs of `spec` (the baseline and a fresh interpreter's) say of the
    trainer's noise, with the tolerance it earns (`cap`: --loss-tol, the most any comparison
    allows). `warm_again_agrees()`, asked only when their losses differ, says whether another warm
    run repeats the baseline: then the difference is the process's (process_dependence), not
    noise. `traced`: the runs were traced, so their filesystem operations can be compared."""
    rows = loss_mismatches(base.losses, again.losses, cap)
    losses = None
    if rows or set(again.losses) != set(base.losses):
        losses = (process_dependence(rows) if warm_again_agrees() else
                  "not deterministic without interruption: two uninterrupted runs differ\n" + format_mismatches(rows))
    lined_up = alignment.align_job(base, again)
    operations = None
    if lined_up.divergence is not None and traced:
        operations = ("the filesystem operations of two uninterrupted runs differ, so a crash point "
                      "cannot be replayed exactly (threads racing in a save, or names that are neither "
                      "a function of the step nor fresh per run)\n    "
                      + lined_up.divergence.describe("run 1", "run 2"))
    noise = run_noise(base, again)
    tolerance = learned(None if losses else noise, cap, comparable_digests(base, again))
    if spec.world_size > 2 and tolerance.exact:
        tolerance = dataclasses.replace(tolerance, value=cap, reason=MANY_RANKS)
    logged = {n for curve in (base.result.rank_losses or (base.losses,)) for d in getattr(curve, "states", {}).values()
              for n in d}
    numbers = evidence.Determinism(
        spec=spec.describe(), exit_codes=(base.result.returncode, again.result.returncode),
        steps=len(base.losses), max_abs_diff=noise, tolerance=tolerance.value, basis=tolerance.describe(),
        digests_left_out=tuple(sorted(logged - set(tolerance.digests))),
        mismatches=evidence.mismatch_rows(rows[:10]), operations=len(base.mutations),
        run_random_names=tuple(n.describe() for n in lined_up.names),
        divergence=lined_up.divergence.describe("run 1", "run 2") if lined_up.divergence else "",
        retention_varies=alignment.retention_outcome(base, again))
    return Determinism(losses, operations, lined_up, numbers, tolerance)


def comparable_digests(base: RecordedRun, again: RecordedRun) -> tuple[str, ...]:
    """State components both uninterrupted runs log with equal digests at every step: for a job,
    on every rank (digests.comparable)."""
    curves = list(zip(base.result.rank_losses, again.result.rank_losses)) or [(base.losses, again.losses)]
    found = [set(digests.comparable(a, b)) for a, b in curves]
    return tuple(sorted(set.intersection(*found))) if found else ()


def run_noise(base: RecordedRun, again: RecordedRun) -> float | None:
    """The largest |diff| between two uninterrupted runs: the global curve's and, for a job, each
    rank's own (a rank can differ where the mean of the ranks does not)."""
    pairs = [(base.losses, again.losses)] + list(zip(base.result.rank_losses, again.result.rank_losses))
    diffs = [d for a, b in pairs if (d := max_abs_diff(a, b)) is not None]
    return max(diffs) if diffs else None


def process_dependence(rows) -> str:
    """determinism_precondition's failure when a fresh interpreter's uninterrupted run differs from
    the warm runner's, which another warm run repeats (rows: loss_mismatches, fresh against warm)."""
    first = (f"from step {rows[0][0]} ({rows[0][1]:.8g} in the warm run, {rows[0][2]:.8g} in the fresh one)"
             if rows and rows[0][1] is not None else "in which steps it logged")
    return ("not deterministic across processes: a fresh interpreter's uninterrupted run differs from the warm "
            f"runner's {first}; the trainer depends on the process it runs in (the order of a set or dict of "
            "strings and hash() change with each interpreter's hash secret; a generator seeded from the OS, such as "
            "random.Random() or numpy's default_rng() without a seed, draws differently; the environment), so "
            "every real restart gives it another curve\n" + format_mismatches(rows, columns=("warm", "fresh")))
