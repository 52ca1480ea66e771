"""Reports: the numbers behind every verdict, as a JSON report and a Markdown summary.

Checks call `record(...)` while they run; the pytest plugin attaches what a test recorded to its
report (as a `user_properties` entry, which pytest-xdist carries from workers to the controller
and `--junitxml` writes as a property), and the controller writes `report.json` and `summary.md`.
`python -m conformance report report.json` renders a saved report again.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import platform
from pathlib import Path
from typing import Any

REPORT_SCHEMA = "conformance-report/1"
PROPERTY = "conformance"

_recorded: list[dict[str, Any]] = []


def record(kind: str, **numbers: Any) -> None:
    """Attach the numbers behind a verdict to the running test (one entry per trial or case)."""
    _recorded.append(jsonable({"kind": kind, **numbers}))


def take() -> list[dict[str, Any]]:
    """What the running test recorded so far; clears it."""
    out = list(_recorded)
    _recorded.clear()
    return out


def jsonable(value: Any) -> Any:
    """Plain JSON values: non-finite floats become strings, tuples lists, keys strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


def mismatch_rows(rows) -> list[dict[str, Any]]:
    return [{"step": s, "baseline": b, "resumed": g, "abs_diff": d} for s, b, g, d in rows]


def max_abs_diff(baseline: dict[int, float], resumed: dict[int, float]) -> float | None:
    diffs = [abs(resumed[s] - baseline[s]) for s in resumed if s in baseline]
    return max(diffs) if diffs else None


# -- building and rendering ------------------------------------------------------------------------
def check_id_of(test_name: str) -> str:
    """`test_corruption_detected[bitflip]` -> `corruption_detected[bitflip]`."""
    return test_name[5:] if test_name.startswith("test_") else test_name


def environment(adapter: dict[str, Any] | None, profile: str | None) -> dict[str, Any]:
    from . import __version__
    versions = {"suite": __version__, "python": platform.python_version()}
    for name in ("torch", "hypothesis", "pytest"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # pragma: no cover - reported as missing
            versions[name] = None
    return {"versions": versions, "adapter": adapter, "hypothesis_profile": profile,
            "platform": platform.platform(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def build_report(cases: list[dict[str, Any]], env: dict[str, Any]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for case in cases:
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    return {"schema": REPORT_SCHEMA, **env, "counts": counts,
            "cases": sorted(cases, key=lambda c: c["check"])}


def load_report(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such report file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON report: {exc}") from None
    if not isinstance(report, dict) or report.get("schema") != REPORT_SCHEMA:
        found = report.get("schema") if isinstance(report, dict) else type(report).__name__
        raise ValueError(f"{path}: not a conformance report (schema {found!r}, expected {REPORT_SCHEMA!r})")
    if not isinstance(report.get("cases"), list):
        raise ValueError(f"{path}: report has no 'cases' list")
    return report


_ICON = {"passed": "pass", "failed": "**FAIL**", "error": "**ERROR**", "skipped": "skip",
         "xfailed": "xfail (expected)", "xpassed": "xpass (remove the expected-failure entry)"}


def _summary_of(case: dict[str, Any]) -> str:
    """One line of numbers for the table."""
    ev = case.get("evidence") or []
    if case["outcome"] in ("skipped", "xfailed") and case.get("reason"):
        return case["reason"].replace("|", "\\|")[:160]
    if not ev:
        return ""
    trials = [e for e in ev if e.get("kind") == "trial"]
    parts = []
    if trials:
        schedules = list(dict.fromkeys(t.get("schedule", "?") for t in trials))
        parts.append(f"{len(trials)} trial(s), schedules " + ", ".join(schedules[:6])
                     + (" ..." if len(schedules) > 6 else ""))
        diffs = [t["max_abs_diff"] for t in trials if isinstance(t.get("max_abs_diff"), (int, float))]
        if diffs:
            parts.append(f"max |loss diff| {max(diffs):.3g}")
    parts += [e.get("summary") or e.get("text", "") for e in ev if e.get("kind") != "trial"]
    return "; ".join(p for p in parts if p).replace("|", "\\|")[:300]


def render_markdown(report: dict[str, Any]) -> str:
    adapter = report.get("adapter") or {}
    v = report.get("versions") or {}
    counts = report.get("counts") or {}
    bad = counts.get("failed", 0) + counts.get("error", 0)
    verdict = "FAILED" if bad else "passed"
    lines = [f"## Resume conformance: {verdict}",
             "",
             f"Trainer `{adapter.get('name', '?')}` (`{adapter.get('spec', '?')}`"
             + (f", version {adapter['version']}" if adapter.get("version") else "") + ") · "
             f"suite {v.get('suite')} · torch {v.get('torch')} · Python {v.get('python')} · "
             f"Hypothesis profile `{report.get('hypothesis_profile') or 'default'}`",
             "",
             " · ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no checks ran",
             "",
             "| check | outcome | evidence |",
             "|---|---|---|"]
    for case in report["cases"]:
        lines.append(f"| `{case['check']}` | {_ICON.get(case['outcome'], case['outcome'])} | {_summary_of(case)} |")
    failures = [c for c in report["cases"] if c["outcome"] in ("failed", "error")]
    for case in failures:
        lines += ["", f"### `{case['check']}`", "", "```", (case.get("message") or "").rstrip(), "```"]
        for plot in case.get("plots") or []:
            lines.append(f"Plot: `{plot}`")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    json_path, md_path = directory / "report.json", directory / "summary.md"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(render_markdown(report))
    return json_path, md_path
