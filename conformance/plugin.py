"""pytest plugin (entry point `pytest11: conformance`): options, fixtures, the trainer named up front,
expected failures, and the hooks that hand each check's report to the report collection (`collect`).

    pytest --pyargs conformance -n auto --adapter=pkg.module:attr
    pytest --pyargs conformance -n auto --trainer-cmd="python train.py --foo"

Both can live in the team's pytest configuration (`conformance_adapter = ...`,
`conformance_trainer_cmd = ...`), so the CI gate is `pytest --pyargs conformance -n auto`.
"""
from __future__ import annotations

import dataclasses
import gc
import os
from pathlib import Path

import pytest

from . import collect
from .checks import Session
from .model import evidence
from .model import settings as _settings  # registers the Hypothesis profiles
from .model.adapters import AdapterError, TrainerAdapter, checked_shape, checked_world_size, declared, resolve
from .model.flags import FLAGS
from .model.settings import DEFAULT_GRACE_S, DEFAULT_HANG_TIMEOUT_S, DEFAULT_TOL
from .options import (  # noqa: F401
    DEFAULT_REPORT_DIR,
    OPTIONS,
    USAGE_PREFIX,
    accept_old_profile_name,
    add_options,
    add_short_spellings,
    number,
    option,
    platform_problem,
    rdzv_port,
    resume_interpreter,
)
from .report import expected
from .report.usage import (
    multirank_problems,
    profile_problem,
    trainer_naming_problem,
    unknown_ini_keys,
)
from .run.fresh import SubprocessRunner
from .run.launch import JobConfig
from .run.warm import WarmRunner
from .run.zygote import die_with_parent


def pytest_addoption(parser):
    add_options(parser)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """Once every plugin and the initial conftests registered their options, the suite's short
    spellings (--adapter, --runner, ...) become aliases of its --conformance-* options, except a
    flag someone else registered: that one stays theirs, and pytest starts with both installed."""
    result = yield
    early_config._conformance_short_taken = add_short_spellings(parser)
    return result


@pytest.fixture(scope="session")
def conformance_session_for(request, tmp_path_factory):
    """Factory: a cached Session for an adapter given by class attribute or options."""
    config = request.config
    cache: dict = {}
    tol = number(config, "loss_tol", DEFAULT_TOL)
    timeout = number(config, "process_timeout", None)
    grace = number(config, "grace_seconds", DEFAULT_GRACE_S)
    jobs = JobConfig(port=rdzv_port(config))
    cold = option(config, "cold_url") or "file"
    if cold != "file" and not cold.startswith("s3://"):
        raise pytest.UsageError(f"{USAGE_PREFIX}--cold-url must be 'file' or s3://bucket/prefix, got {cold!r}")
    s3 = None
    resume_python = resume_interpreter(config)
    hang_timeout = number(config, "hang_timeout", DEFAULT_HANG_TIMEOUT_S)

    def get(adapter=None, trainer_cmd=None, world_size=None, nnodes=None) -> Session:
        if adapter is None and trainer_cmd is None:
            adapter, trainer_cmd = option(config, "adapter"), option(config, "trainer_cmd")
        key = (repr(adapter), trainer_cmd, world_size, nnodes)
        if not cache and hasattr(config, "workerinput"):
            # An xdist worker goes on with its test when its controller is ended (a CI system's
            # SIGTERM on cancel): it would keep starting trainers. It ends with its controller
            # instead, and what it started ends with it (docs/running.md, "Nothing left behind").
            die_with_parent(os.getppid())
        if key not in cache:
            resolved = _resolve(config, adapter, trainer_cmd, world_size, nnodes)
            runner = SubprocessRunner(jobs=jobs) if option(config, "runner") == "fresh" else WarmRunner(jobs=jobs)
            plot_dir = Path(option(config, "report") or DEFAULT_REPORT_DIR).resolve() / "plots"
            nonlocal s3
            if cold.startswith("s3://") and resolved.has("cold_tier") and s3 is None:
                from .run.coldstore import LoopbackS3
                s3 = LoopbackS3(cold)
            cache[key] = Session(resolved, tmp_path_factory.mktemp("conformance"), runner=runner, tol=tol,
                                 plot_dir=plot_dir, process_timeout=timeout, grace_s=grace, cold=cold,
                                 resume_python=resume_python, hang_timeout=hang_timeout)
        return cache[key]

    yield get
    for session in cache.values():
        session.close()
    if s3 is not None:
        s3.stop()


def _resolve(config, adapter, trainer_cmd, world_size=None, nnodes=None) -> TrainerAdapter:
    """The trainer named by a class attribute or the options; AdapterError if it cannot be loaded.
    The world size (and node count): the --world-size (--nnodes) option, else `world_size`
    (`nnodes`) as a class attribute, else the adapter's own. --capabilities and --carry-env apply
    to each (adapters.declared)."""
    size = option(config, "world_size") or world_size
    nodes = option(config, "nnodes") or nnodes
    capabilities, carry_env = option(config, "capabilities"), option(config, "carry_env")
    if isinstance(adapter, TrainerAdapter):
        if size:
            adapter = dataclasses.replace(adapter, world_size=checked_world_size(size, "--world-size"))
        if nodes:
            adapter = dataclasses.replace(adapter, nnodes=checked_world_size(nodes, "--nnodes", "nodes"))
        resolved = checked_shape(declared(adapter, capabilities, carry_env, os.environ))
    elif adapter is not None and not isinstance(adapter, str):
        raise AdapterError(f"the adapter class attribute is {adapter!r}",
                           "set it to a 'package.module:attribute' string or a TrainerAdapter")
    else:
        resolved = resolve(adapter, trainer_cmd, rootdir=config.rootpath, world_size=size, nnodes=nodes,
                           capabilities=capabilities, carry_env=carry_env)
    # What is loaded by now (torch, through the trainer's module) lives as long as the process:
    # kept out of every later collection, and out of the ones pytest's unraisable-exception cleanup
    # runs at exit, each of which would walk torch's objects again. Only once a trainer is loaded:
    # a pytest run that merely has this plugin installed keeps its collector as it was.
    _SUITE_LOADED.append(True)
    _freeze()
    return resolved


_SUITE_LOADED: list[bool] = []   # a trainer was loaded for this run


def _freeze() -> None:
    """Freeze, where nothing else has (some interpreters start with objects frozen): unfreezing for
    a team's test could then not restore what they had."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        _FROZEN.append(gc.get_freeze_count())


def _suite_requested(config) -> bool:
    """Whether this run is about the conformance suite (so the trainer is named up front): an
    option or ini key names a trainer, or the suite's own test module is collected."""
    if any(option(config, name) for name in ("adapter", "trainer_cmd")):
        return True
    args = [str(a) for a in config.args]
    return (config.getoption("pyargs", False) and any(a.split("::")[0] == "conformance" for a in args)) \
        or any("test_conformance.py" in a for a in args)


# -- collection: subclasses, expected failures ----------------------------------------------------
def _conformance_class(item):
    from .suite import ResumeConformance
    cls = getattr(item, "cls", None)
    return cls if cls is not None and issubclass(cls, ResumeConformance) else None


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """A ResumeConformance subclass that names its trainer wrongly is a usage error, not a run
    against the bundled trainer. Raised as a collection error (a worker cannot stop the session);
    the controller turns the first one into the session's single usage error."""
    if isinstance(obj, type) and name.startswith("Test"):
        from .suite import ResumeConformance
        if issubclass(obj, ResumeConformance):
            problem = platform_problem() or obj.conformance_problem()
            if problem is None and not obj.configured_by_options:
                try:
                    _resolve(collector.config, obj.adapter, obj.trainer_cmd, obj.world_size, obj.nnodes)
                except AdapterError as exc:
                    problem = f"{obj.__module__}.{obj.__qualname__}: {exc}"
            if problem:
                raise pytest.Collector.CollectError(USAGE_PREFIX + problem)


class UsageErrors:
    """Controller-side: the first usage error found while collecting (by any xdist worker) stops
    the session as one pytest.UsageError, before any test runs."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collectreport(self, report):
        text = str(report.longrepr) if report.failed else ""
        if text.startswith(USAGE_PREFIX):
            raise pytest.UsageError(text.removeprefix(USAGE_PREFIX).strip())


@pytest.hookimpl(tryfirst=True)   # before Hypothesis's own, which loads the profile
def pytest_configure(config):
    accept_old_profile_name(config.getoption("hypothesis_profile", None))
    if not hasattr(config, "workerinput"):   # the controller (or a run without xdist): check once
        problem = unknown_ini_keys(config, {ini for _, ini in OPTIONS.values()}) \
            or profile_problem(config.getoption("hypothesis_profile", None)) or _settings.EXAMPLE_DB_PROBLEM
        if problem:
            raise pytest.UsageError(problem)
        # Every value is checked before any test runs, the same way from the command line or the ini file.
        for name in ("loss_tol", "process_timeout", "grace_seconds", "hang_timeout"):
            number(config, name, None)
        rdzv_port(config)
        resume_interpreter(config)
        config._conformance_adapter = None
        named = {name: option(config, name) for name in ("adapter", "trainer_cmd")}
        requested = _suite_requested(config)
        if requested and (elsewhere := platform_problem()):
            raise pytest.UsageError(elsewhere)
        spelled = {f.name: (f.spelling, f.ini_key) for f in FLAGS}   # as the user most likely typed it
        problem = trainer_naming_problem(named, spelled, os.environ if requested else {})
        if problem:
            raise pytest.UsageError(problem)
        if requested:
            try:
                adapter = _resolve(config, named["adapter"], named["trainer_cmd"])
            except AdapterError as exc:
                raise pytest.UsageError(f"cannot use the trainer: {exc}") from None
            error, warning = multirank_problems(adapter, rdzv_port(config))
            if error:
                raise pytest.UsageError(f"cannot launch the trainer's ranks: {error}")
            if warning:
                config.issue_config_time_warning(pytest.PytestConfigWarning(f"conformance: {warning}"), stacklevel=2)
            config._conformance_adapter = adapter
    path = option(config, "expected_failures")
    entries = []
    if path:
        try:
            entries = expected.parse(path)
        except expected.ExpectedFailuresError as exc:
            raise pytest.UsageError(str(exc)) from None
    config._conformance_expected = (path, entries)
    if not hasattr(config, "workerinput"):   # the controller (or a run without xdist)
        config.pluginmanager.register(collect.ReportCollector(config), "conformance-report")
        config.pluginmanager.register(UsageErrors(), "conformance-usage-errors")

def pytest_report_header(config):
    header = collect.run_header(config)
    return [header] if header else None


def pytest_collection_modifyitems(config, items):
    path, entries = getattr(config, "_conformance_expected", (None, []))
    strict = not option(config, "expected_failures_lenient")
    for item in items:
        if entries and _conformance_class(item) is not None:
            entry = expected.match(entries, _check_id(item))
            if entry is not None:
                item.add_marker(pytest.mark.xfail(
                    strict=strict, reason=f"expected failure ({path}:{entry.line} {entry.check}): {entry.reason}; "
                                          "if this check passes, remove the entry"))


def _check_id(item) -> str:
    name = item.name
    return name[5:] if name.startswith("test_") else name


# -- each test: a fresh evidence record, the collector's freeze, the report's property --------------
def pytest_runtest_setup(item):
    evidence.take()
    _collector_for(item)


_FROZEN: list[int] = []   # how many objects the suite froze, while they are frozen


def _collector_for(item) -> None:
    """The suite's freeze (`_freeze`) for its own tests only: a team's test in the same session
    runs with Python's collector as the interpreter had it, frozen again for the next suite test."""
    mine = _conformance_class(item) is not None
    if _FROZEN and not mine:
        gc.unfreeze()
        _FROZEN.clear()
    elif mine and not _FROZEN and _SUITE_LOADED:
        _freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach what the check recorded to its report (`collect.attach`), at setup and call."""
    if _conformance_class(item) is not None and call.when in ("setup", "call"):
        collect.attach(item, _check_id(item), call.excinfo)
    yield
