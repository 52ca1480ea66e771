"""Reports: every check's outcome and the evidence behind it, as `report.json` and `summary.md`.

The pytest plugin builds one `Case` per check from what the check recorded (evidence.py) and the
controller writes the report at the end of the session. `python -m conformance report
report.json` renders a saved one again. A merged report (merge.py: a campaign's shards joined)
holds several cases per check: its counts are the cases', its levels take each check's worst
outcome, and its failures are listed once per check and schedule.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import platform
from pathlib import Path
from typing import Any

from ..model.evidence import Determinism, Draws, Evidence, HelpersLeft, Intermittent, RunnerDisagreement, Trial
from ..model.settings import VERSION

REPORT_SCHEMA = "conformance-report/2"
PROPERTY = "conformance"   # the user_properties key a check's case travels under


@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    name: str
    spec: str
    version: str
    capabilities: tuple[str, ...]


@dataclasses.dataclass
class Case:
    check: str                 # the check id, with its parameter: `corruption_detected[bitflip]`
    nodeid: str
    outcome: str               # passed, failed, error, skipped, xfailed, xpassed
    reason: str = ""           # why skipped or expected to fail
    duration_s: float = 0.0
    message: str = ""
    evidence: list[Evidence] = dataclasses.field(default_factory=list)
    plots: list[str] = dataclasses.field(default_factory=list)
    adapter: AdapterInfo | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["evidence"] = [e.to_json() for e in self.evidence]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Case:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["evidence"] = [Evidence.from_json(e) for e in data.get("evidence") or []]
        adapter = data.get("adapter")
        values["adapter"] = AdapterInfo(**{**adapter, "capabilities": tuple(adapter.get("capabilities", ()))}) \
            if isinstance(adapter, dict) else None
        return cls(**values)

    @property
    def failure(self) -> tuple[str, str]:
        """(check id, schedule): two failed cases with the same are one failure (found twice in a
        campaign). The schedule is the message's `schedule:` line; a failure without one is known by
        its `replay:` line, which names its case exactly, else by its whole message."""
        lines = [line.strip() for line in self.message.splitlines()]
        for prefix in ("schedule:", "replay:"):
            found = next((line for line in lines if line.startswith(prefix)), None)
            if found is not None:
                return self.check, found
        return self.check, self.message.strip()


# A check's outcome across several cases (a merged report): the first of these any case had. A check
# passed only where it passed wherever it ran; one that ran nowhere was skipped.
OUTCOME_ORDER = ("error", "failed", "xfailed", "xpassed", "passed", "skipped")


@dataclasses.dataclass(frozen=True)
class Source:
    """One report a merged report joined (`python -m conformance report --merge`), as it was written."""
    path: str
    created: str
    counts: dict[str, int]
    header: str = ""


@dataclasses.dataclass
class Report:
    versions: dict[str, str | None]
    adapter: AdapterInfo | None
    hypothesis_profile: str | None
    platform: str
    created: str
    cases: list[Case]
    header: str = ""            # the session header line: trainer, profile, runner, strace
    schema: str = REPORT_SCHEMA
    sources: list[Source] = dataclasses.field(default_factory=list)   # a merged report's shards; [] for one run

    @property
    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for case in self.cases:
            counts[case.outcome] = counts.get(case.outcome, 0) + 1
        return counts

    @property
    def disagreements(self) -> list[tuple[Case, RunnerDisagreement]]:
        """Each case the warm runner failed and a fresh interpreter passed (the suite's problem)."""
        return [(c, e) for c in self.cases for e in c.evidence if isinstance(e, RunnerDisagreement)]

    @property
    def intermittent(self) -> list[tuple[Case, Intermittent]]:
        """Each failed case whose replays in both runners changed its verdict (a race: the trainer's),
        or never failed again (not reproducible: the trainer's failure as found)."""
        return [(c, e) for c in self.cases for e in c.evidence if isinstance(e, Intermittent)]

    @property
    def failed(self) -> list[Case]:
        """The failed and errored cases, each failure once (`Case.failure`): the first case of it."""
        distinct: dict[tuple[str, str], Case] = {}
        for case in self.cases:
            if case.outcome in ("failed", "error"):
                distinct.setdefault(case.failure, case)
        return list(distinct.values())

    @property
    def outcomes(self) -> dict[str, str]:
        """Each check id's outcome; with several cases of a check, the first in OUTCOME_ORDER."""
        rank = {outcome: i for i, outcome in enumerate(OUTCOME_ORDER)}
        out: dict[str, str] = {}
        for case in self.cases:
            seen = out.get(case.check)
            if seen is None or rank.get(case.outcome, -1) < rank.get(seen, -1):
                out[case.check] = case.outcome
        return out

    @property
    def comparison(self) -> str:
        """How the resumes were judged: "exact" (bitwise) or the learned tolerance, from the
        determinism runs (several different ones in a merged report: each, once)."""
        found = dict.fromkeys(e.basis for c in self.cases for e in c.evidence if isinstance(e, Determinism) and e.basis)
        return "; ".join(found)

    @property
    def warnings(self) -> list[str]:
        """Findings that fail no check: retention whose outcome differs between two uninterrupted
        runs (each, once); a check judged on fewer drawn cases than it could not deliver; a helper
        process that wrote under the checkpoint directory after its trainer exited."""
        return list(dict.fromkeys(
            f"retention's outcome varies between two uninterrupted runs ({e.spec}): {e.retention_varies}. Which "
            "checkpoints survive depends on timing (a deletion racing a save in flight), so a restart may find fewer "
            "than the retention policy promises" for c in self.cases for e in c.evidence
            if isinstance(e, Determinism) and e.retention_varies)) \
            + [f"`{c.check}` {c.outcome} on {e.summary()}" for c in self.cases for e in c.evidence
               if isinstance(e, Draws) and e.undelivered > e.delivered] \
            + [f"`{c.check}`: {e.summary().removeprefix('WARNING: ')}" for c in self.cases for e in c.evidence
               if isinstance(e, HelpersLeft) and e.wrote]

    def levels(self):
        from .levels import assess
        return assess(self.outcomes)

    def to_json(self) -> dict[str, Any]:
        from .levels import highest
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("cases", "sources")}
        if self.sources:
            out["sources"] = [dataclasses.asdict(s) for s in self.sources]
        out["adapter"] = dataclasses.asdict(self.adapter) if self.adapter else None
        levels = self.levels()
        top = highest(levels)
        return {**out, "counts": self.counts, "runner_disagreements": len(self.disagreements),
                "intermittent": sum(e.reproduced for _, e in self.intermittent),
                "not_reproducible": sum(not e.reproduced for _, e in self.intermittent),
                "warnings": self.warnings, "level": top.level if top else None,
                "levels": [dataclasses.asdict(s) for s in levels], "cases": [c.to_json() for c in self.cases]}


def environment(adapter: AdapterInfo | None, profile: str | None, cases: list[Case], header: str = "") -> Report:
    versions: dict[str, str | None] = {"suite": VERSION, "python": platform.python_version()}
    for name in ("torch", "hypothesis", "pytest"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # pragma: no cover - reported as missing
            versions[name] = None
    return Report(versions, adapter, profile, platform.platform(),
                  _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                  sorted(cases, key=lambda c: c.check), header)


def load_report(path: str | Path) -> Report:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such report file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON report: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: not a conformance report (schema {found!r}, expected {REPORT_SCHEMA!r})")
    if not isinstance(data.get("cases"), list):
        raise ValueError(f"{path}: report has no 'cases' list")
    try:
        adapter = data.get("adapter")
        return Report(versions=data.get("versions") or {},
                      adapter=AdapterInfo(**{**adapter, "capabilities": tuple(adapter.get("capabilities", ()))})
                      if isinstance(adapter, dict) else None,
                      hypothesis_profile=data.get("hypothesis_profile"), platform=data.get("platform", ""),
                      created=data.get("created", ""), header=data.get("header", ""),
                      cases=[Case.from_json(c) for c in data["cases"]],
                      sources=[Source(**s) for s in data.get("sources") or []])
    except (TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{path}: malformed report: {exc}") from None


_ICON = {"passed": "pass", "failed": "**FAIL**", "error": "**ERROR**", "skipped": "skip",
         "xfailed": "xfail (expected)", "xpassed": "xpass (remove the expected-failure entry)"}


def summary_of(case: Case) -> str:
    """One line of numbers for the table."""
    if case.outcome in ("skipped", "xfailed") and case.reason:
        return case.reason.replace("|", "\\|")[:160]
    trials = [e for e in case.evidence if isinstance(e, Trial)]
    parts = []
    if trials:
        schedules = list(dict.fromkeys(t.schedule for t in trials))
        parts.append(f"{len(trials)} trial(s), schedules " + ", ".join(schedules[:6])
                     + (" ..." if len(schedules) > 6 else ""))
        diffs = [t.max_abs_diff for t in trials if t.max_abs_diff is not None]
        if diffs:
            parts.append(f"max |loss diff| {max(diffs):.3g}")
    parts += [e.summary() for e in case.evidence if not isinstance(e, Trial)]
    return "; ".join(p for p in parts if p).replace("|", "\\|")[:300]


def render_markdown(report: Report) -> str:
    adapter = report.adapter
    v = report.versions
    counts = report.counts
    verdict = "FAILED" if report.failed else "passed"
    trainer = (f"Trainer `{adapter.name}` (`{adapter.spec}`" + (f", version {adapter.version}" if adapter.version else "")
               + ")") if adapter else "Trainer unknown"
    lines = [f"## Resume conformance: {verdict}",
             "",
             f"{trainer} · suite {v.get('suite')} · torch {v.get('torch')} · Python {v.get('python')} · "
             f"Hypothesis profile `{report.hypothesis_profile or 'default'}`",
             ""]
    if report.header:
        lines += [f"`{report.header}`", ""]
    from .levels import highest
    levels = report.levels()
    top = highest(levels)
    lines += [f"**Conformance level: {f'{top.level} ({top.meaning})' if top else 'none met'}** · "
              + " · ".join(f"{s.level} {s.status}" for s in levels), ""]
    lines += [" · ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no checks ran", ""]
    if report.comparison:
        exact = report.comparison.startswith("0 (exact")
        lines += [("**Resumes judged exact**: every resumed loss must equal the uninterrupted run's bit for bit ("
                   "tolerance " if exact else "Resumes judged within tolerance ") + report.comparison
                  + (")" if exact else ""), ""]
    lines += [f"**Warning**: {w}" for w in report.warnings] + ([""] if report.warnings else [])
    disagreements = report.disagreements
    if disagreements:
        lines += [f"**{len(disagreements)} runner disagreement(s)**: the warm runner failed a case that a fresh "
                  "interpreter per process passed. The suite's problem, not the trainer's (the checks passed): "
                  "please report it with the lines below.", ""]
        for _, found in disagreements:
            lines += ["```", found.summary(), found.warm.rstrip(), "```", ""]
    intermittent = report.intermittent
    if intermittent:
        raced = sum(e.reproduced for _, e in intermittent)
        lines += [f"**{raced} intermittent failure(s), {len(intermittent) - raced} not reproducible**: a failure that "
                  "came back in some replays of its case and not in others (a race in the trainer), or in none (a race "
                  "these runs did not hit again, or a one-off fault of the warm runner). Failed either way; each "
                  "failure below lists every run's outcome.", ""]
    lines += ["| check | outcome | evidence |", "|---|---|---|"]
    lines += _rows(report.cases)
    for case in report.failed:
        found = sum(c.outcome in ("failed", "error") and c.failure == case.failure for c in report.cases)
        lines += ["", f"### `{case.check}`" + (f" (found {found} times)" if found > 1 else ""), "", "```",
                  case.message.rstrip(), "```"]
        for plot in case.plots:
            lines.append(f"Plot: `{plot}`")
    if report.sources:
        lines += ["", f"Merged from {len(report.sources)} report(s):", ""]
        lines += [f"- `{s.path}`: " + (" · ".join(f"{n} {k}" for k, n in sorted(s.counts.items())) or "no checks ran")
                  + (f" ({s.created})" if s.created else "") for s in report.sources]
    return "\n".join(lines) + "\n"


def _rows(cases: list[Case]) -> list[str]:
    """One table row per check id; a check with several cases (a merged report) tallies their outcomes
    and shows the evidence of its first failure, else of its first case."""
    by_check: dict[str, list[Case]] = {}
    for case in cases:
        by_check.setdefault(case.check, []).append(case)
    rows = []
    for check, group in by_check.items():
        if len(group) == 1:
            outcome = _ICON.get(group[0].outcome, group[0].outcome)
        else:
            tally = {o: sum(c.outcome == o for c in group) for o in dict.fromkeys(c.outcome for c in group)}
            order = sorted(tally, key=lambda o: OUTCOME_ORDER.index(o) if o in OUTCOME_ORDER else -1)
            outcome = ", ".join(f"{_ICON.get(o, o)} ×{tally[o]}" for o in order)
        shown = next((c for c in group if c.outcome in ("failed", "error")), group[0])
        rows.append(f"| `{check}` | {outcome} | {summary_of(shown)} |")
    return rows


def write_report(report: Report, directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    json_path, md_path = directory / "report.json", directory / "summary.md"
    json_path.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    md_path.write_text(render_markdown(report))
    return json_path, md_path
