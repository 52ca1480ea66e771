"""pytest plugin (entry point `pytest11: conformance`): options, Hypothesis profiles, fixtures.

    pytest --pyargs conformance -n auto --adapter=pkg.module:attr
    pytest --pyargs conformance -n auto --trainer-cmd="python train.py --foo"

Both can live in the team's pytest configuration (`conformance_adapter = ...`,
`conformance_trainer_cmd = ...`), so the CI gate is a bare `pytest -n auto`.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from . import checks, expected
from . import report as reports
from .adapters import resolve
from .trials import SubprocessRunner, WarmRunner

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.function_scoped_fixture])
# A gate must give the same verdict on the same code every time: quick is derandomized, and ci
# draws from a fixed seed (suite.py applies it) while still replaying the failures kept in the
# example database, e.g. ones a nightly fuzz run found (derandomize=True would turn the database
# off). fuzz explores: random draws, failures kept in the database.
EXAMPLE_DB = DirectoryBasedExampleDatabase(".hypothesis/examples")
settings.register_profile("quick", max_examples=3, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], **_COMMON)
settings.register_profile("ci", max_examples=8, derandomize=False, database=EXAMPLE_DB, **_COMMON)
settings.register_profile("fuzz", max_examples=5000, derandomize=False, database=EXAMPLE_DB, **_COMMON)
SEEDED_PROFILES = {"ci": 0}


def pytest_addoption(parser):
    group = parser.getgroup("conformance", "resume-determinism conformance suite")
    group.addoption("--adapter", default=None,
                    help="Python adapter 'package.module:attribute' (default: the bundled reference trainer)")
    group.addoption("--trainer-cmd", default=None,
                    help="command that starts the trainer following the command contract")
    group.addoption("--runner", choices=("warm", "fresh"), default=None,
                    help="warm: fork trainer processes from a process that imported torch once "
                         "(default); fresh: a new interpreter per process")
    group.addoption("--loss-tol", type=float, default=None,
                    help=f"max absolute loss difference per step (default {checks.DEFAULT_TOL:g})")
    group.addoption("--conformance-report", default=None, metavar="DIR",
                    help="write DIR/report.json (every check, its outcome and the numbers behind it), "
                         "DIR/summary.md (for a pull request) and DIR/plots/*.png")
    group.addoption("--expected-failures", default=None, metavar="FILE",
                    help="lines '<check id substring> : <reason>': matching checks are xfail")
    parser.addini("conformance_adapter", "default for --adapter")
    parser.addini("conformance_report", "default for --conformance-report")
    parser.addini("conformance_expected_failures", "default for --expected-failures")
    parser.addini("conformance_trainer_cmd", "default for --trainer-cmd")
    parser.addini("conformance_loss_tol", "default for --loss-tol")
    parser.addini("conformance_runner", "default for --runner")


def _option(config, name: str):
    opt = {"adapter": "--adapter", "trainer_cmd": "--trainer-cmd", "loss_tol": "--loss-tol",
           "runner": "--runner", "report": "--conformance-report",
           "expected_failures": "--expected-failures"}[name]
    value = config.getoption(opt)
    if value is None:
        value = config.getini(f"conformance_{name}") or None
    return value


@pytest.fixture(scope="session")
def conformance_session_for(request, tmp_path_factory):
    """Factory: a cached checks.Session for an adapter given by class attribute or options."""
    config = request.config
    cache: dict = {}
    tol = _option(config, "loss_tol")
    tol = float(tol) if tol is not None else checks.DEFAULT_TOL

    def get(adapter=None, trainer_cmd=None) -> checks.Session:
        if adapter is None and trainer_cmd is None:
            adapter, trainer_cmd = _option(config, "adapter"), _option(config, "trainer_cmd")
        key = (repr(adapter), trainer_cmd)
        if key not in cache:
            if adapter is not None and not isinstance(adapter, str):
                from .adapters import TrainerAdapter
                resolved = adapter if isinstance(adapter, TrainerAdapter) else None
                if resolved is None:
                    raise pytest.UsageError(f"adapter class attribute must be a 'pkg.mod:attr' string or "
                                            f"a TrainerAdapter, got {adapter!r}")
            else:
                try:
                    resolved = resolve(adapter, trainer_cmd)
                except (ImportError, AttributeError, ValueError, TypeError) as exc:
                    raise pytest.UsageError(f"cannot load the trainer adapter: {exc}") from exc
            runner = SubprocessRunner() if _option(config, "runner") == "fresh" else WarmRunner()
            report_dir = _option(config, "report")
            plot_dir = Path(report_dir).resolve() / "plots" if report_dir else None
            cache[key] = checks.Session(resolved, tmp_path_factory.mktemp("conformance"), runner=runner, tol=tol,
                                        plot_dir=plot_dir)
        return cache[key]

    yield get
    for session in cache.values():
        session.close()


# -- expected failures and reports ----------------------------------------------------------------
def _is_conformance_item(item) -> bool:
    cls = getattr(item, "cls", None)
    return cls is not None and any(c.__name__ == "ResumeConformance" and c.__module__ == "conformance.suite"
                                   for c in cls.__mro__)


def pytest_configure(config):
    path = _option(config, "expected_failures")
    entries = []
    if path:
        try:
            entries = expected.parse(path)
        except expected.ExpectedFailuresError as exc:
            raise pytest.UsageError(str(exc)) from None
    config._conformance_expected = entries
    if not hasattr(config, "workerinput"):   # the controller (or a run without xdist)
        for e in expected.unmatched(entries):
            warnings.warn(pytest.PytestWarning(
                f"{path}:{e.line}: expected failure {e.pattern!r} matches no check id "
                f"(known: {', '.join(expected.all_check_ids())})"))
        config.pluginmanager.register(ReportCollector(config), "conformance-report")


def pytest_collection_modifyitems(config, items):
    entries = getattr(config, "_conformance_expected", [])
    for item in items:
        if entries and _is_conformance_item(item):
            entry = expected.match(entries, reports.check_id_of(item.name))
            if entry is not None:
                item.add_marker(pytest.mark.xfail(reason=f"expected failure ({entry.pattern}): {entry.reason}"))


def pytest_runtest_setup(item):
    reports.take()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach what the check recorded to its report: pytest-xdist carries user_properties from
    workers to the controller, and --junitxml writes them as properties."""
    if _is_conformance_item(item) and call.when in ("setup", "call"):
        session = getattr(item, "funcargs", {}).get("session")
        adapter = getattr(session, "adapter", None)
        message = ""
        if call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
            exc = call.excinfo.value
            message = str(exc) if isinstance(exc, AssertionError) else call.excinfo.exconly()
        payload = {"check": reports.check_id_of(item.name), "evidence": reports.take(), "message": message,
                   "adapter": None if adapter is None else
                   {"name": adapter.name, "spec": adapter.spec, "version": adapter.version,
                    "capabilities": sorted(adapter.capabilities)}}
        item.user_properties[:] = [(k, v) for k, v in item.user_properties if k != reports.PROPERTY]
        item.user_properties.append((reports.PROPERTY, json.dumps(payload)))
    yield


def case_from_report(rep) -> dict | None:
    """One report.json case from a test report carrying our property (None for other tests)."""
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
    plots = [e["path"] for e in data["evidence"] if e.get("kind") == "plot"]
    return {"check": data["check"], "nodeid": rep.nodeid, "outcome": outcome, "reason": reason,
            "duration_s": round(rep.duration, 3), "adapter": data["adapter"],
            "message": (data.get("message") or rep.longreprtext) if outcome in ("failed", "error", "xfailed") else "",
            "evidence": [e for e in data["evidence"] if e.get("kind") != "plot"], "plots": plots}


class ReportCollector:
    """Controller-side: gathers every check's case and writes report.json and summary.md."""

    def __init__(self, config):
        self.config = config
        self.cases: list[dict] = []

    def pytest_runtest_logreport(self, report):
        case = case_from_report(report)
        if case is not None:
            self.cases.append(case)

    def pytest_terminal_summary(self, terminalreporter):
        directory = _option(self.config, "report")
        if not directory or not self.cases:
            return
        adapter = next((c["adapter"] for c in self.cases if c.get("adapter")), None)
        profile = self.config.getoption("hypothesis_profile", None)
        built = reports.build_report(self.cases, reports.environment(adapter, profile))
        json_path, md_path = reports.write_report(built, Path(directory).resolve())
        terminalreporter.write_line(f"conformance report: {json_path} and {md_path}")
