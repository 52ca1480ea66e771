"""The numbers behind every verdict, as typed records.

Checks `record(...)` evidence while they run; the pytest plugin attaches what a test recorded to its
report (a `user_properties` entry: pytest-xdist carries it from workers to the controller and
`--junitxml` writes it as a property), and report.py renders it. Records cross process boundaries
as JSON (`to_json` / `from_json`) and are used as objects everywhere else.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, ClassVar

_KINDS: dict[str, type] = {}


def jsonable(value: Any) -> Any:
    """Plain JSON values: non-finite floats become strings, tuples lists, keys strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)   # "inf" / "nan" as written by jsonable
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class Mismatch:
    step: int
    baseline: float | None
    resumed: float
    abs_diff: float


def mismatch_rows(rows) -> tuple[Mismatch, ...]:
    return tuple(Mismatch(s, b, g, d) for s, b, g, d in rows)


class Evidence:
    """Base of every evidence record: a `kind` tag, JSON round trip and a one-line summary."""

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.kind:
            _KINDS[cls.kind] = cls

    def summary(self) -> str:
        return ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **jsonable(dataclasses.asdict(self)), "summary": self.summary()}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Evidence:
        cls = _KINDS.get(data.get("kind", ""))
        if cls is None:
            return Note(f"unknown evidence kind {data.get('kind')!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        # JSON has no tuples: every sequence field is a tuple here, as it was when recorded.
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields}
        if "mismatches" in values:
            values["mismatches"] = tuple(Mismatch(**m) for m in values["mismatches"] or ())
        if "crashes" in values:
            values["crashes"] = tuple(CrashRecord(**c) for c in values["crashes"] or ())
        for name in ("max_abs_diff",):
            if name in values:
                values[name] = _number(values[name])
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class CrashRecord:
    point: str
    planned: str
    inside_save_of: int | None
    newest_committed: int
    resumed_from: int


@dataclasses.dataclass(frozen=True)
class Trial(Evidence):
    kind: ClassVar[str] = "trial"
    check: str
    schedule: str
    spec: str
    crashes: tuple[CrashRecord, ...]
    final_exit: int
    steps_compared: int
    max_abs_diff: float | None
    tolerance: float
    mismatches: tuple[Mismatch, ...] = ()


@dataclasses.dataclass(frozen=True)
class Determinism(Evidence):
    kind: ClassVar[str] = "determinism"
    spec: str
    exit_codes: tuple[int, ...]
    steps: int
    max_abs_diff: float | None
    tolerance: float
    mismatches: tuple[Mismatch, ...] = ()
    operations: int = 0                     # mutations under the checkpoint dir per run
    run_random_names: tuple[str, ...] = ()  # learned from the two runs
    divergence: str = ""                    # the first operation the runs differ at
    basis: str = ""                         # the learned tolerance, described (tolerance.Tolerance)
    digests_left_out: tuple[str, ...] = ()  # state components logged whose digests differ between the runs
    retention_varies: str = ""              # the checkpoints each run kept, where they differ

    def summary(self) -> str:
        diff = f"{self.max_abs_diff:.3g}" if self.max_abs_diff is not None else "n/a"
        names = f", {len(self.run_random_names)} run-random name(s)" if self.run_random_names else ""
        ops = f"; operations differ: {self.divergence}" if self.divergence else \
            f"; same {self.operations} filesystem operations{names}"
        learned = f"; every resume is held to tolerance {self.basis}" if self.basis else ""
        left = (f"; state digests not compared (they differ between the two runs): {', '.join(self.digests_left_out)}"
                if self.digests_left_out else "")
        kept = f"; retention's outcome varies: {self.retention_varies}" if self.retention_varies else ""
        return f"two uninterrupted runs, {self.steps} steps, max |diff| {diff}{ops}{learned}{left}{kept}"


@dataclasses.dataclass(frozen=True)
class CrashStates(Evidence):
    kind: ClassVar[str] = "crash_states"
    states: int
    operations: int
    failed: int
    failing: tuple[str, ...] = ()
    distinct: int = 0            # distinct directories (states that leave the same one are decided once)
    resumed: int = 0             # states run (the others differ only in files a resume never looked at)
    shared: int = 0              # resumes another offline check had run in a directory with the same files

    def summary(self) -> str:
        return (f"{self.states} crash states rebuilt from {self.operations} recorded operations"
                + (f" ({decided(self.distinct, self.resumed, self.shared)})" if self.distinct else "")
                + (f", {self.failed}+ failing" if self.failed else ", all resumed correctly"))


def decided(distinct: int, resumed: int, shared: int = 0) -> str:
    reused = (f"; {shared} of those resumes were run once for another offline check, in a directory with the same "
              "files" if shared else "")
    if not resumed or resumed == distinct:
        return f"{distinct} distinct directories decided" + reused
    return (f"{distinct} distinct directories, {resumed} resumed: the others differ from one of those only in "
            "files its resume never looked at" + reused)


@dataclasses.dataclass(frozen=True)
class PowerLoss(Evidence):
    kind: ClassVar[str] = "power_loss"
    model: str
    states: int
    failed: int
    failing: tuple[str, ...] = ()
    distinct: int = 0
    resumed: int = 0
    shared: int = 0

    def summary(self) -> str:
        return (f"{self.states} power-loss states ({self.model} model"
                + (f", {decided(self.distinct, self.resumed, self.shared)})" if self.distinct else ")")
                + (f", {self.failed}+ failing" if self.failed else ", all resumed correctly"))


@dataclasses.dataclass(frozen=True)
class Fault(Evidence):
    """A storage error or a SIGTERM delivered at one operation, and what followed."""

    kind: ClassVar[str] = "fault"
    check: str
    point: str
    planned: str
    fault: str                 # ENOSPC, EIO, SIGTERM
    first_exit: int
    went_on: bool              # kept training (stopped by the suite) / still running after the grace period
    resumed_from: int
    final_exit: int

    def summary(self) -> str:
        first = "went on" if self.went_on else f"exit {self.first_exit}"
        return (f"{self.fault} at {self.point}: {first}; next start resumed from step {self.resumed_from}, "
                f"exit {self.final_exit}")


@dataclasses.dataclass(frozen=True)
class Corruption(Evidence):
    kind: ClassVar[str] = "corruption"
    corruption: str
    file: str
    what: str
    newest_step: int
    exit_code: int
    resumed_from: int
    max_abs_diff: float | None

    def summary(self) -> str:
        return (f"{self.corruption} {self.file}: exit {self.exit_code}, "
                + (f"resumed from step {self.resumed_from}" if self.exit_code == 0 else "refused to resume"))


@dataclasses.dataclass(frozen=True)
class Untrusted(Evidence):
    kind: ClassVar[str] = "untrusted"
    files: tuple[str, ...]
    code_ran: tuple[str, ...]
    exit_codes: tuple[int, ...]

    def summary(self) -> str:
        return (f"{len(self.files)} file(s) replaced one at a time by a code-running pickle: code "
                + (f"RAN for {', '.join(self.code_ran)}" if self.code_ran else "never ran"))


@dataclasses.dataclass(frozen=True)
class Legacy(Evidence):
    kind: ClassVar[str] = "legacy"
    sample: str
    step: int
    seed: int
    exit_code: int
    resumed_from: int
    max_abs_diff: float | None

    def summary(self) -> str:
        return f"{self.sample}: exit {self.exit_code}, resumed from step {self.resumed_from}"


@dataclasses.dataclass(frozen=True)
class Plot(Evidence):
    kind: ClassVar[str] = "plot"
    path: str


@dataclasses.dataclass(frozen=True)
class RunnerDisagreement(Evidence):
    """A case the warm runner failed and a fresh interpreter per process passed, replayed once:
    the warm runner did not stand in for a real restart. The suite's problem, never the trainer's
    failure."""

    kind: ClassVar[str] = "runner_disagreement"
    check: str
    case: str
    warm: str      # the warm run's failure, as it was reported
    fresh: str     # what the fresh replay did

    def summary(self) -> str:
        return (f"RUNNER DISAGREEMENT: the warm runner failed {self.check}{f' ({self.case})' if self.case else ''} "
                f"and a fresh interpreter {self.fresh}: the suite's problem, not the trainer's")


@dataclasses.dataclass(frozen=True)
class Note(Evidence):
    kind: ClassVar[str] = "note"
    text: str

    def summary(self) -> str:
        return self.text


@dataclasses.dataclass(frozen=True)
class Compared(Evidence):
    """Every loss comparison a test judged by, in one record: how many curves, how many steps, the
    largest |diff| seen and the tolerance it was held to."""

    kind: ClassVar[str] = "compared"
    curves: int
    steps: int
    max_abs_diff: float | None
    tolerance: float
    basis: str                 # tolerance.Tolerance.describe(): exact, learned from noise, or the cap and why
    exact: bool

    def summary(self) -> str:
        diff = "n/a" if self.max_abs_diff is None else f"{self.max_abs_diff:.3g}"
        return (f"{'exact: ' if self.exact else ''}{self.steps} step(s) of {self.curves} resumed curve(s) compared, "
                f"max |diff| {diff}, tolerance {self.basis}")

    def merged(self, steps: int, worst: float | None) -> Compared:
        both = [d for d in (self.max_abs_diff, worst) if d is not None]
        return dataclasses.replace(self, curves=self.curves + 1, steps=self.steps + steps,
                                   max_abs_diff=max(both) if both else None)


@dataclasses.dataclass(frozen=True)
class Draws(Evidence):
    """How many of a test's drawn cases the suite delivered (judged), and how many it could not
    (a point the run never reaches: another was drawn), with the first reasons."""

    kind: ClassVar[str] = "draws"
    delivered: int
    undelivered: int
    reasons: tuple[str, ...] = ()

    def summary(self) -> str:
        total = self.delivered + self.undelivered
        why = f" (e.g. {self.reasons[0]})" if self.reasons else ""
        return f"{self.delivered} of {total} drawn case(s) delivered; {self.undelivered} could not be{why}"


_recorded: list[Evidence] = []
_compared: list[Compared] = []      # at most one: the running test's comparisons so far
_draws: list[Draws] = []            # at most one: the running test's draws so far
_lock = threading.Lock()            # crash states judge from several threads


def record(item: Evidence) -> None:
    """Attach evidence to the running test (one record per trial or case)."""
    with _lock:
        _recorded.append(item)


def compared(steps: int, worst: float | None, tolerance: float, basis: str, exact: bool) -> None:
    """One resumed curve was compared with its baseline: folded into the test's Compared record."""
    with _lock:
        if _compared and _compared[0].basis == basis:
            _compared[0] = _compared[0].merged(steps, worst)
        else:
            if _compared:
                _recorded.append(_compared.pop())
            _compared.append(Compared(1, steps, worst, tolerance, basis, exact))


def drawn(delivered: bool, reason: str = "") -> None:
    """One drawn case was delivered (judged) or not: folded into the test's Draws record."""
    with _lock:
        seen = _draws.pop() if _draws else Draws(0, 0)
        reasons = seen.reasons if delivered or len(seen.reasons) >= 3 or reason in seen.reasons else \
            (*seen.reasons, reason)
        _draws.append(Draws(seen.delivered + delivered, seen.undelivered + (not delivered), reasons))


def take() -> list[Evidence]:
    """What the running test recorded so far; clears it. Draws are reported only where some
    could not be delivered."""
    with _lock:
        out = list(_recorded) + list(_compared) + [d for d in _draws if d.undelivered]
        _recorded.clear()
        _compared.clear()
        _draws.clear()
    return out
