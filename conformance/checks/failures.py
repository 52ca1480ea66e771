"""The failure messages users read: the check id, what happened, the first differing steps, and
one command line that replays exactly this case."""
from __future__ import annotations

import shlex

from ..model import evidence
from ..model.adapters import TrainerAdapter
from ..model.process import ProcessResult, RunSpec
from .digests import StateMismatch, first_state_mismatch
from .fixes import CauseFix
from .tolerance import Tolerance


class ConformanceFailure(AssertionError):
    """A check failed; the message is the report. `spec` and `case` (the check's replay options)
    say which case failed, where the check named one: what a replay, or a confirmation in a fresh
    interpreter, reruns. `fix`: the cause the check's evidence found, where it changes what to fix
    (fixes.CauseFix); the `fix:` line the registry appends says it instead of the check's default."""

    spec: RunSpec | None = None
    case: dict[str, str] | None = None
    fix: CauseFix | None = None


class CheckNotApplicable(Exception):
    """This trainer's run offers the check nothing to do (its cases cannot be set up); the test
    skips with the message as its reason, as for a missing capability."""


class Mismatches(list):
    """loss_mismatches' rows, with the tolerance they were found against (format_mismatches says
    what a difference means for an exact trainer) and the first state digest that differs. A
    resume whose state differs while its losses agree gets that step as its one row: it fails."""

    tolerance: Tolerance | None = None
    state: StateMismatch | None = None

    @property
    def state_only(self) -> bool:
        return self.state is not None and all(d <= self.tolerance.value for *_, d in self)

    def first_problem(self, baseline: dict[int, float]) -> str:
        """The first difference, in words: a state component's, or the first step's loss."""
        if self.state_only:
            return f"its {self.state.describe()} (its losses match)"
        step, _, got, _ = self[0]
        base = baseline.get(step)
        return f"its loss at step {step} is {got:.8g}, baseline " + ("missing" if base is None else f"{base:.8g}")


def loss_mismatches(baseline: dict[int, float], resumed: dict[int, float], tol: float | Tolerance) -> Mismatches:
    """(step, baseline, resumed, |difference|) for every resumed step outside tolerance. A verdict's
    comparison passes a Tolerance (session.tolerance): it is recorded as the test's evidence; a bare
    number is an experiment's comparison, not recorded."""
    bad = Mismatches()
    bound = tol.value if isinstance(tol, Tolerance) else tol
    for step in sorted(resumed):
        expected = baseline.get(step)
        if expected is None:
            bad.append((step, None, resumed[step], float("inf")))
            continue
        diff = abs(resumed[step] - expected)
        if not diff <= bound:  # NaN counts as a mismatch
            bad.append((step, expected, resumed[step], diff))
    if isinstance(tol, Tolerance):
        bad.tolerance = tol
        bad.state = first_state_mismatch(baseline, resumed, tol.digests)
        if bad.state is not None and not bad and resumed:
            # the first step logged at or after the difference carries it (a set-up difference: the next one)
            step = min((s for s in resumed if s >= bad.state.step + bad.state.at_setup), default=min(resumed))
            expected = baseline.get(step)
            bad.append((step, expected, resumed[step], float("inf") if expected is None else abs(resumed[step] - expected)))
        if resumed:
            evidence.compared(len(resumed), max_abs_diff(baseline, resumed), tol.value, tol.describe(), tol.exact)
    return bad


def rank_mismatches(base: ProcessResult, got: ProcessResult, tol: float | Tolerance) -> list[tuple[int, list]]:
    """(rank, its mismatch rows) for every rank whose curve leaves its own uninterrupted curve."""
    out = []
    for r, curve in enumerate(got.rank_losses):
        own = base.rank_losses[r] if r < len(base.rank_losses) else {}
        rows = loss_mismatches(own, curve, tol)
        if rows:
            out.append((r, rows))
    return out


def describe_ranks(bad: list[tuple[int, list]], world_size: int) -> str:
    fine = sorted(set(range(world_size)) - {r for r, _ in bad})
    lines = [f"  rank {r}: differs at {len(rows)} step(s)\n" + format_mismatches(rows) for r, rows in bad]
    if fine:
        lines.append(f"  rank(s) {', '.join(map(str, fine))}: match their own uninterrupted curve")
    return "\n".join(lines)


def max_abs_diff(baseline: dict[int, float], resumed: dict[int, float]) -> float | None:
    diffs = [abs(resumed[s] - baseline[s]) for s in resumed if s in baseline]
    return max(diffs) if diffs else None


def format_mismatches(rows, limit: int = 5, columns: tuple[str, str] = ("baseline", "resumed")) -> str:
    lines = [f"    step   {columns[0]:<17} {columns[1]:<17} |diff|"]
    for step, base, got, diff in rows[:limit]:
        b = "missing" if base is None else f"{base:.8g}"
        lines.append(f"    {step:<6} {b:<17} {got:<17.8g} {diff:.3g}")
    if len(rows) > limit:
        lines.append(f"    ... {len(rows) - limit} more")
    state = getattr(rows, "state", None)
    if state is not None:
        lines.append(f"    state: {state.describe()}")
    tolerance = getattr(rows, "tolerance", None)
    # An exact trainer's difference under the cap is the one that needs explaining (it would have
    # passed a fixed tolerance); a larger one speaks for itself.
    if tolerance is not None and (not tolerance.exact or all(d <= tolerance.cap for *_, d in rows)):
        lines.append(tolerance.verdict_line())
    return "\n".join(lines)


def replay_command(adapter: TrainerAdapter, check: str, spec: RunSpec, case: dict[str, str] | None = None) -> str:
    """`python -m conformance replay ...` for one case (after `env NAME=VALUE` where the run carries
    variables: TrainerAdapter.replay_env); `case` holds the check's own options."""
    parts = [*adapter.replay_env(), "python", "-m", "conformance", "replay", *adapter.replay_args(), f"--check={check}",
             f"--total-steps={spec.total_steps}", f"--save-every={spec.save_every}", f"--seed={spec.seed}"]
    parts += [f"--{k.replace('_', '-')}={v}" for k, v in (case or {}).items()]
    return " ".join(shlex.quote(p) for p in parts)


def fail(check: str, adapter: TrainerAdapter, spec: RunSpec, problem: str, *, details: str = "",
         case: dict[str, str] | None = None, schedule: str | None = None, fix: CauseFix | None = None) -> ConformanceFailure:
    lines = [f"[{check}] {problem}",
             f"  trainer:  {adapter.name}",
             f"  run:      {spec.describe()}"]
    if schedule is not None:
        lines.append(f"  schedule: {schedule}")
    if details:
        lines.append(details.rstrip())
    lines.append(f"  replay:   {replay_command(adapter, check, spec, case)}")
    note = adapter.replay_note()
    if note:
        lines.append(f"            {note}")
    failure = ConformanceFailure("\n".join(lines))
    failure.spec, failure.case, failure.fix = spec, case, fix
    return failure


def step_ranges(steps) -> str:
    """`[1, 2, 3, 5]` -> "steps 1-3, 5"; "" for none."""
    steps = sorted(steps)
    if not steps:
        return ""
    runs, start = [], steps[0]
    for a, b in zip(steps, steps[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(runs)


def stderr_tail(text: str, n: int = 6) -> str:
    tail = [line for line in text.strip().splitlines() if line.strip()][-n:]
    return "\n".join("    | " + line for line in tail) if tail else "    | (no stderr)"
