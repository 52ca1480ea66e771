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
        if "helpers" in values:
            values["helpers"] = tuple(Helper(**{**h, "paths": tuple(h.get("paths") or ())}) for h in values["helpers"] or ())
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
    left_out: int = 0            # states the suite could not rebuild (not decided: its problem, not the trainer's)
    left_out_reasons: tuple[str, ...] = ()

    def summary(self) -> str:
        if self.left_out:
            return (f"{self.states} crash states from {self.operations} recorded operations, "
                    f"{left_out(self.left_out, self.left_out_reasons)}"
                    + (f" ({decided(self.distinct, self.resumed, self.shared)})" if self.distinct else "")
                    + (f", {self.failed}+ failing" if self.failed else ", the rest resumed correctly" if self.resumed
                       else ""))
        return (f"{self.states} crash states rebuilt from {self.operations} recorded operations"
                + (f" ({decided(self.distinct, self.resumed, self.shared)})" if self.distinct else "")
                + (f", {self.failed}+ failing" if self.failed else ", all resumed correctly"))


def left_out(count: int, reasons: tuple[str, ...]) -> str:
    """States the suite could not rebuild, counted with the first reason: its problem, never the trainer's."""
    return (f"{count} left out because the suite cannot rebuild them" + (f" (e.g. {reasons[0]})" if reasons else "")
            + ": not decided")


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
    left_out: int = 0            # states the suite could not rebuild (not decided: its problem, not the trainer's)
    left_out_reasons: tuple[str, ...] = ()

    def summary(self) -> str:
        return (f"{self.states} power-loss states ({self.model} model"
                + (f", {decided(self.distinct, self.resumed, self.shared)})" if self.distinct else ")")
                + (f", {left_out(self.left_out, self.left_out_reasons)}" if self.left_out else "")
                + (f", {self.failed}+ failing" if self.failed else ", the rest resumed correctly" if self.left_out
                   and self.resumed else "" if self.left_out else ", all resumed correctly"))


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
    """A case the warm runner failed every time it ran it and a fresh interpreter per process passed
    every time (suite.py replays it in both): the warm runner did not stand in for a real restart.
    The suite's problem, never the trainer's failure."""

    kind: ClassVar[str] = "runner_disagreement"
    check: str
    case: str
    warm: str      # the warm run's failure, as it was reported
    fresh: str     # what the fresh replays did

    def summary(self) -> str:
        return (f"RUNNER DISAGREEMENT: the warm runner failed {self.check}{f' ({self.case})' if self.case else ''} "
                f"and a fresh interpreter {self.fresh}: the suite's problem, not the trainer's")


def _runs_text(failed: tuple[bool, ...]) -> str:
    return ", ".join("failed" if f else "passed" for f in failed) or "none"


@dataclasses.dataclass(frozen=True)
class Intermittent(Evidence):
    """A failing case replayed in both runners (suite.py) whose verdict changed between runs of that
    one case, or that never failed again: the trainer's failure either way, with every run's outcome
    per runner. `reproduced`: it failed again in some replay (intermittent), else it was not
    reproducible."""

    kind: ClassVar[str] = "intermittent"
    check: str
    case: str
    warm: tuple[bool, ...]     # each warm run of the case, in order, failed (True) or passed; the first found it
    fresh: tuple[bool, ...]    # each fresh replay, in order
    undelivered: int = 0       # replays not delivered (no such case, fault not landed): neither failed nor passed
    shape: str = ""            # the race's likely shape, from the evidence, or "cannot tell" and the candidates

    @property
    def failed(self) -> int:
        return sum(self.warm) + sum(self.fresh)

    @property
    def runs(self) -> int:
        return len(self.warm) + len(self.fresh)

    @property
    def reproduced(self) -> bool:
        return self.failed > 1

    def outcomes(self) -> str:
        return (f"warm runner: {_runs_text(self.warm)}; fresh interpreter: {_runs_text(self.fresh)}"
                + (f"; {self.undelivered} more not delivered (no such case in its run, or its fault not landed "
                   "where planned)" if self.undelivered else ""))

    def summary(self) -> str:
        what = "INTERMITTENT" if self.reproduced else "NOT REPRODUCIBLE"
        return (f"{what}: {self.check}{f' ({self.case})' if self.case else ''} failed {self.failed} of {self.runs} "
                f"runs of the case ({self.outcomes()})")


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


@dataclasses.dataclass(frozen=True)
class Helper:
    """A process a trainer started that was still running when the trainer's own process ended."""

    pid: int
    command: str
    wrote_checkpoint: bool = False   # it wrote under the checkpoint directory after the trainer exited (as far as
    #                                  the run's trace shows, or the moment the suite watched it before ending it)
    paths: tuple[str, ...] = ()      # what it wrote there, relative to the checkpoint directory
    ended: bool = True               # the suite ended it (False: it exited by itself, after the trainer)


HELPERS_SHOWN = 4


@dataclasses.dataclass(frozen=True)
class HelpersLeft(Evidence):
    """Processes trainers started (a data server, a logging service) and left running when their
    own process ended, for one test: each trainer's own exit status counted, and the suite ended
    them (run/watchdog.py). One that wrote under the checkpoint directory after its trainer exited
    is a warning: in production it can race the next start."""

    kind: ClassVar[str] = "helpers_left"
    runs: int                         # trainer processes (or jobs) that left helpers running
    count: int                        # helpers, in all
    helpers: tuple[Helper, ...]       # the first HELPERS_SHOWN, those that wrote first
    unattributed: tuple[str, ...] = ()   # paths that changed under the checkpoint directory after a trainer
    #                                      exited while only its helpers ran, not tied to one of them

    @property
    def wrote(self) -> bool:
        return bool(self.unattributed) or any(h.wrote_checkpoint for h in self.helpers)

    def summary(self) -> str:
        shown = "; ".join(f"pid {h.pid} `{' '.join(h.command.split())[:100]}`"
                          + (f" wrote {', '.join(h.paths[:3])} after its trainer exited" if h.paths else "")
                          + ("" if h.ended else ", then exited by itself") for h in self.helpers)
        more = f" and {self.count - len(self.helpers)} more" if self.count > len(self.helpers) else ""
        text = (f"{self.count} helper process(es) outlived the trainer process that started them ({self.runs} run(s)): "
                f"{shown}{more}; each trainer's own exit status counted, and the suite ended those still running")
        if not self.wrote:
            return text
        where = f" (changed: {', '.join(self.unattributed[:3])})" if self.unattributed else ""
        return ("WARNING: a helper process wrote under the checkpoint directory after its trainer exited" + where
                + ": in production it can race the next start, which may read the directory while it writes. " + text)

    def merged(self, helpers: tuple[Helper, ...], unattributed: tuple[str, ...]) -> HelpersLeft:
        every = sorted((*self.helpers, *helpers), key=lambda h: not h.wrote_checkpoint)
        return HelpersLeft(self.runs + 1, self.count + len(helpers), tuple(every[:HELPERS_SHOWN]),
                           tuple(dict.fromkeys((*self.unattributed, *unattributed)))[:HELPERS_SHOWN])


_recorded: list[Evidence] = []
_compared: list[Compared] = []      # at most one: the running test's comparisons so far
_draws: list[Draws] = []            # at most one: the running test's draws so far
_helpers: list[HelpersLeft] = []    # at most one: the helpers the running test's trainers left
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


def helpers_left(helpers: tuple[Helper, ...], unattributed: tuple[str, ...] = ()) -> None:
    """One trainer process (or job) left `helpers` running: folded into the test's HelpersLeft record."""
    with _lock:
        seen = _helpers.pop() if _helpers else HelpersLeft(0, 0, ())
        _helpers.append(seen.merged(helpers, unattributed))


def warnings() -> list[str]:
    """What the running test recorded so far that a failure's text repeats (a helper that wrote
    under the checkpoint directory after its trainer exited); clears nothing."""
    with _lock:
        return [h.summary() for h in _helpers if h.wrote]


def take() -> list[Evidence]:
    """What the running test recorded so far; clears it. Draws are reported only where some
    could not be delivered."""
    with _lock:
        out = list(_recorded) + list(_compared) + [d for d in _draws if d.undelivered] + list(_helpers)
        _recorded.clear()
        _compared.clear()
        _draws.clear()
        _helpers.clear()
    return out
