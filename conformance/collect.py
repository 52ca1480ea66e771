"""The report a run writes: each check's test report carries what the check recorded (`attach`, on
the worker), and the controller turns those into cases (`case_from_report`) and writes report.json and
summary.md once the session ends (`ReportCollector`). The plugin registers the collector and calls
`attach` from its hooks.

A check runs in an xdist worker and the report is written by the controller: what the check recorded
travels in its test report's user_properties, which pytest-xdist carries from workers to the
controller (and --junitxml writes as properties). Both ends of that property are here, so what a
worker attaches and what the controller reads back cannot drift apart.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from .model import evidence
from .model import settings as _settings
from .options import DEFAULT_REPORT_DIR, option
from .report import report as reports
from .report.usage import describe_setup


def run_header(config) -> str:
    """The trainer, profile, runner and strace of this run (after every plugin has configured): pytest's
    header shows it and the report records it, computed once so the two say the same."""
    adapter = getattr(config, "_conformance_adapter", None)
    if adapter is None:
        return ""
    if getattr(config, "_conformance_header", None) is None:
        config._conformance_header = describe_setup(adapter, option(config, "runner"))
    return config._conformance_header


def attach(item, check: str, excinfo) -> None:
    """Worker-side: attach what check `check` recorded (its evidence, its failure's message, the
    trainer) to its report as our property, replacing one attached at an earlier phase."""
    session = getattr(item, "funcargs", {}).get("session")
    adapter = getattr(session, "adapter", None)
    message = ""
    if excinfo is not None and not excinfo.errisinstance(pytest.skip.Exception):
        message = failure_message(excinfo.value)
    payload = {"check": check, "evidence": [e.to_json() for e in evidence.take()], "message": message,
               "adapter": None if adapter is None else
               {"name": adapter.name, "spec": adapter.spec, "version": adapter.version,
                "capabilities": sorted(adapter.capabilities)}}
    item.user_properties[:] = [(k, v) for k, v in item.user_properties if k != reports.PROPERTY]
    item.user_properties.append((reports.PROPERTY, json.dumps(payload)))


def failure_message(exc: BaseException) -> str:
    """What a failed check's report says: a check's own message as it wrote it, else the
    exception's type and text. An exception group (Hypothesis's FlakyFailure: a draw failed, and
    its replay did something else) says each exception inside it too, where the first
    failure's message is."""
    if not str(exc) and exc.__cause__ is not None and not isinstance(exc, BaseExceptionGroup):
        return failure_message(exc.__cause__)   # a wrapper (Hypothesis wraps a pytest.fail in a group)
    if isinstance(exc, pytest.fail.Exception):
        text = exc.msg
    elif isinstance(exc, AssertionError):
        text = str(exc)
    else:
        name = type(exc).__qualname__
        text = f"{type(exc).__module__}.{name}: {exc}" if type(exc).__module__ != "builtins" else f"{name}: {exc}"
    if isinstance(exc, BaseExceptionGroup):
        for n, inner in enumerate(exc.exceptions, 1):
            text += f"\n  inner exception {n}: " + failure_message(inner).replace("\n", "\n    ")
    return text


def case_from_report(rep) -> reports.Case | None:
    """One report case from a test report carrying our property (None for other tests)."""
    raw = next((v for k, v in rep.user_properties if k == reports.PROPERTY), None)
    if raw is None or not (rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed")):
        return None
    data = json.loads(raw)
    outcome = {"passed": "passed", "failed": "failed" if rep.when == "call" else "error",
               "skipped": "skipped"}[rep.outcome]
    reason = ""
    if hasattr(rep, "wasxfail"):
        outcome, reason = ("xpassed" if rep.passed else "xfailed"), rep.wasxfail
    elif rep.skipped and isinstance(rep.longrepr, tuple):
        reason = str(rep.longrepr[2]).removeprefix("Skipped: ")
    case = reports.Case.from_json({**data, "nodeid": rep.nodeid, "outcome": outcome, "reason": reason,
                                   "duration_s": round(rep.duration, 3)})
    case.plots = [e.path for e in case.evidence if isinstance(e, evidence.Plot)]
    case.evidence = [e for e in case.evidence if not isinstance(e, evidence.Plot)]
    if outcome not in ("failed", "error", "xfailed"):
        case.message = ""
    elif not case.message:
        case.message = rep.longreprtext
    return case


def skip_text(reason: str) -> str:
    """A skip's reason without pytest's "Skipped: " prefix, on one line."""
    return " ".join(reason.removeprefix("Skipped: ").split())


class ReportCollector:
    """Controller-side: gathers every check's case and writes report.json and summary.md."""

    def __init__(self, config):
        self.config = config
        self.cases: list[reports.Case] = []

    def pytest_runtest_logreport(self, report):
        case = case_from_report(report)
        if case is not None:
            self.cases.append(case)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.cases:
            return
        tested = dict.fromkeys(f"{c.adapter.name} ({c.adapter.spec})" for c in self.cases if c.adapter)
        if tested:
            terminalreporter.write_line(f"conformance: tested {', '.join(tested)}")
        skipped = [c for c in self.cases if c.outcome == "skipped"]
        if skipped:   # the suite's own skips, with why, without -rs: a skip is a check that did not run
            terminalreporter.write_line(f"conformance: {len(skipped)} check(s) did not run:")
            for case in sorted(skipped, key=lambda c: c.check):
                terminalreporter.write_line(f"  {case.check}: {skip_text(case.reason)}")
        directory = option(self.config, "report") or DEFAULT_REPORT_DIR
        adapter = next((c.adapter for c in self.cases if c.adapter), None)
        profile = _settings.suite_profile(self.config.getoption("hypothesis_profile", None) or "default")
        built = reports.environment(adapter, profile, self.cases, run_header(self.config))
        for _, found in built.disagreements:   # passed for the trainer; a problem of the suite's, said out loud
            terminalreporter.write_line(f"conformance: {found.summary()}", yellow=True, bold=True)
        for warning in built.warnings:   # findings that fail no check, where a passing run shows them too
            terminalreporter.write_line(f"conformance: warning: {warning}", yellow=True)
        json_path, md_path = reports.write_report(built, Path(directory).resolve())
        terminalreporter.write_line(f"conformance report: {json_path} and {md_path}")

