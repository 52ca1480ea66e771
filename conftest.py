"""Development only: the project's own tests run against this checkout, and share a few helpers.

- The imported `conformance`, `reference` and `fixtures` must be this checkout's, not a stale
  installed copy (`pip install -e .` makes them so).
- Helpers the tests share, as fixtures and markers (never imported by bare name):
  `@pytest.mark.needs_strace` (skips, naming why, where strace cannot trace and inject),
  `@pytest.mark.needs_extra("compression", ...)` (skips, naming the extra, where its packages are missing),
  `repo_root`, `run_pytest` (pytest in a subprocess) and `run_suite` (the conformance suite the
  way a team runs it, with its verdicts read from JUnit XML). Both fork their pytest process from
  one that imported torch once (`run_python_pytest`; tests/test_dev_harness.py checks that it
  sees what a fresh interpreter would).

Nothing here is an option, a Hypothesis profile or a fixture the installed plugin needs: `pytest
--pyargs conformance` behaves the same from this checkout and from an install
(tests/test_conformance_plugin.py checks that).
"""
from __future__ import annotations

import functools
import importlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent

for _name in ("conformance", "resume_conformance.reference", "resume_conformance.fixtures"):
    _where = Path(importlib.import_module(_name).__file__).resolve()
    if not _where.is_relative_to(REPO):
        raise pytest.UsageError(
            f"'{_name}' is imported from {_where.parent}, not from this checkout ({REPO}): a stale installed "
            f"copy shadows it. Run `pip install -e {REPO}` (or uninstall the other copy).")


def _extras() -> dict[str, tuple[str, ...]]:
    """pyproject.toml's optional extras, each with the packages it installs (not this project itself,
    which `test` names to gather the others)."""
    import tomllib
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {extra: [re.match(r"[A-Za-z0-9_.-]+", req).group(0) for req in reqs] for extra, reqs in table.items()}
    return {extra: tuple(n for n in packages if n != "resume-conformance") for extra, packages in names.items()}


EXTRAS = _extras()


def missing_extra(*extras: str) -> str | None:
    """Why a test needing these extras cannot run here (a skip reason naming the extra), or None."""
    import importlib.util
    for extra in extras:
        absent = [m for m in EXTRAS[extra] if importlib.util.find_spec(m.replace("-", "_")) is None]
        if absent:
            return (f"needs the '{extra}' extra ({', '.join(absent)} not installed): pip install -e '.[{extra}]', "
                    "or '.[test]' for every test dependency")
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_strace: skip unless strace can trace and inject signals here")
    config.addinivalue_line("markers", "needs_extra(*extras): skip, naming the extra, unless its packages are installed")


_ROOT: list[subprocess.Popen] = []


def pytest_sessionstart(session):
    """Each test process (each xdist worker, not the controller) starts two roots of fork servers
    (tests/forkroot.py), one per hash secret the warm runner gives its servers (a run's saving and
    resuming processes get different ones), and names them in its environment, so the suite
    processes the tests start fork their trainers' servers from them instead of each importing
    torch again in a fresh interpreter. Not for `--pyargs conformance` from the checkout, which runs
    as a team runs it; CONFORMANCE_TESTS_FRESH=1 turns it off. The time it saves is in
    docs/benchmarks.md."""
    from conformance.run.forkclient import ROOT_ENV
    from conformance.run.forkserver import server_env
    from conformance.run.identity import IDENTITIES, random_hash_seeds
    config = session.config
    if (config.option.pyargs or os.environ.get("CONFORMANCE_TESTS_FRESH") == "1" or ROOT_ENV in os.environ
            or (getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ)):
        return
    named = []
    for n, seed in enumerate(random_hash_seeds(IDENTITIES)):
        address = f"@conformance-fork-root-{os.getpid()}-{n}"
        _ROOT.append(subprocess.Popen([sys.executable, "-m", "tests.forkroot", address], cwd=REPO,
                                      env=dict(server_env(os.environ), PYTHONHASHSEED=str(seed)),
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL))
        named.append(f"{address}={seed}")
    os.environ[ROOT_ENV] = ",".join(named)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` runs one worker more than there are CPUs: the tests wait on their subprocesses
    (collective timeouts, barriers, kills), and a third worker on 2 cores fills those waits.
    Measured here, one full run each: 2 workers 950 s with 278 CPU-seconds idle, 3 workers 899 s
    with 71 idle. PYTEST_XDIST_AUTO_NUM_WORKERS still overrides it, and the suite run as a team runs
    it (`--pyargs conformance`) keeps xdist's own count."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or config.option.pyargs:
        return None
    return len(os.sched_getaffinity(0)) + 1


def _expected_length(item) -> int:
    """0 for the longest tests (real-library and multi-rank gate runs, groups of broken trainers), 1 for other
    subprocess tests, 2 for the rest: under -n auto the long ones start first, and short ones fill
    the end, so no worker is left running one long test alone."""
    if not item.get_closest_marker("slow"):
        return 2
    return 0 if any(k in item.nodeid for k in ("test_real_trainers", "ddp", "chain_trainer", "tiered_trainer",
                                                "test_broken_trainers_fail")) else 1


def pytest_collection_modifyitems(config, items):
    items.sort(key=_expected_length)    # stable: each group keeps its collection order
    for item in items:
        for mark in item.iter_markers("needs_extra"):
            reason = missing_extra(*mark.args)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
    marked = [item for item in items if item.get_closest_marker("needs_strace")]
    if not marked:
        return
    from conformance.trace.strace import strace_problem
    problem = strace_problem()
    if problem:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=f"strace unusable: {problem}"))


@pytest.fixture(scope="session")
def require_extras():
    """require_extras(*extras): skip the test (or the fixture) that calls it, naming the first missing
    extra; for fixtures, which cannot carry the needs_extra marker."""
    def require(*extras: str) -> None:
        reason = missing_extra(*extras)
        if reason:
            pytest.skip(reason)
    return require


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


# `python -m pytest`, less the interpreter's teardown once pytest.main has returned (every hook,
# JUnit XML included, has run by then): with torch imported that teardown costs about 0.8 s of
# CPU, paid by every pytest subprocess these fixtures start.
PYTEST = (sys.executable, "-c", "import os, sys, pytest\ncode = pytest.console_main()\n"
                               "sys.stdout.flush()\nsys.stderr.flush()\nos._exit(code)")

# Over a hundred tests start pytest processes, and in each the trainer's adapter imports torch
# (about 2 s of CPU here, a third of it in the kernel). So these are forked instead from one process
# per test worker that imported torch once: the standard library's forkserver (nothing else in it;
# no test, suite or trainer module, which read the environment when imported). Measured on 2
# cores: the full run 20:17 -> 15:50, worker-seconds 2370 -> 1817. The child is made to look like
# `python -c` started in `cwd` with `env` (its sys.path, environment, directory, signals and
# output), then runs PYTEST's code. CONFORMANCE_TESTS_FRESH=1 starts fresh interpreters instead.
PRELOAD = ["torch", "torch.distributed.checkpoint", "numpy"]
_CHILD = """
import importlib, os, signal, sys
argv, cwd, env, out, err, sigint_ignored, path = ARGS
os.environ.clear()
os.environ.update(env)
os.chdir(cwd)
sys.path[:] = path
sys.path_importer_cache.clear()
importlib.invalidate_caches()
sys.argv[:] = ["-c", *argv]
sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.default_int_handler)
for fd, name in ((1, out), (2, err)):
    os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
import pytest
code = pytest.console_main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(PRELOAD)


@functools.cache
def _fresh_path() -> tuple[str, ...]:
    """sys.path of a fresh `python -c` without PYTHONPATH ('' first: the current directory)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out))


def run_python_pytest(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float,
                      sigint_ignored: bool = False) -> subprocess.CompletedProcess:
    """`PYTEST *args` in `cwd` with exactly `env`, its output captured: forked from the preloaded
    forkserver (see PRELOAD), or with CONFORMANCE_TESTS_FRESH=1 a fresh interpreter."""
    if os.environ.get("CONFORMANCE_TESTS_FRESH") == "1":
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        return subprocess.run([*PYTEST, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=ignore)
    extra = [os.path.normpath(os.path.join(cwd, p)) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = ["", *extra, *_fresh_path()[1:]]
    with tempfile.TemporaryDirectory(prefix="pytest-child-") as out_dir:
        out, err = Path(out_dir) / "stdout", Path(out_dir) / "stderr"
        child = _FORKS.Process(target=exec, args=(_CHILD, {"ARGS": (list(args), str(cwd), dict(env), str(out),
                                                                     str(err), sigint_ignored, path)}))
        child.start()
        child.join(timeout)
        timed_out = child.exitcode is None
        if timed_out:
            child.kill()
            child.join()

        def read(p: Path) -> str:
            return p.read_text(errors="replace") if p.exists() else ""
        if timed_out:
            raise subprocess.TimeoutExpired([*PYTEST, *args], timeout, output=read(out), stderr=read(err))
        return subprocess.CompletedProcess([*PYTEST, *args], child.exitcode, read(out), read(err))



# The suite runs these fixtures start report a warm failure without replaying it in a fresh
# interpreter (about 10 s of fresh processes per failure, and the project's tests make well over a
# hundred failures on purpose); a test that is about the confirmation passes --confirm=fresh, which
# overrides it (tests/test_conformance_fidelity.py).
UNCONFIRMED = ("-o", "conformance_confirm=off")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


@pytest.fixture
def run_pytest(tmp_path):
    """run_pytest(*args, cwd=tmp_path, timeout=900, env=None): pytest in a subprocess, quiet, skips reported;
    `env` adds variables to this process's environment."""
    def run(*args: str, cwd: Path | None = None, timeout: float = 900,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return run_python_pytest(["-p", "no:cacheprovider", "-q", "-rs", "-W", "ignore::DeprecationWarning",
                                  f"--basetemp={tmp_path / 'bt'}", *UNCONFIRMED, *args],
                                 cwd=cwd or tmp_path, env={**_env(), **(env or {})}, timeout=timeout)
    return run


def _verdicts(xml: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """{(class, test name): (outcome, message)} from a JUnit XML file (class: the last part of its
    classname, the ResumeConformance subclass)."""
    verdicts = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "") + "\n" + (el.text or "")
        verdicts[(case.get("classname", "").rsplit(".", 1)[-1], case.get("name"))] = (outcome, message)
    return verdicts


def _run_conformance(tmp_path: Path, target: list[str], args: tuple[str, ...], sigint_ignored: bool = False):
    """pytest on `target` with the suite's report in JUnit XML: (verdicts by class and test, console output)."""
    xml = tmp_path / "junit.xml"
    proc = run_python_pytest([*target, "-p", "no:cacheprovider", "-q", f"--junitxml={xml}",
                              f"--basetemp={tmp_path / 'suite'}", "-W", "ignore::DeprecationWarning", *UNCONFIRMED,
                              *args],
                             cwd=tmp_path, env=_env(), timeout=1500, sigint_ignored=sigint_ignored)
    assert xml.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return _verdicts(xml), proc.stdout + proc.stderr


@pytest.fixture
def run_suite(tmp_path):
    """run_suite(*args) -> ({test name: (outcome, message)}, console output): the conformance suite
    run as a team does, `pytest --pyargs conformance`, verdicts read from its JUnit XML."""
    def run(*args: str, sigint_ignored: bool = False) -> tuple[dict[str, tuple[str, str]], str]:
        """`sigint_ignored`: start it as a shell starts a background job (SIGINT ignored)."""
        verdicts, out = _run_conformance(tmp_path, ["--pyargs", "conformance"], args, sigint_ignored)
        return {name: verdict for (_, name), verdict in verdicts.items()}, out
    return run


@pytest.fixture
def run_suite_classes(tmp_path):
    """run_suite_classes({class name: adapter}, {class name: [test names]}, *args) -> ({(class name, test
    name): (outcome, message)}, console output): several trainers in one pytest process, each a
    ResumeConformance subclass in a test module of its own (as a team tests several trainers),
    only the named tests of each run (node ids: a parameterised check's `test_x[param]`, or all its
    params as `test_x`)."""
    def run(adapters: dict[str, str], tests: dict[str, list[str]], *args: str):
        lines = ["from conformance import ResumeConformance", ""]
        for cls, adapter in adapters.items():
            lines += ["", f"class {cls}(ResumeConformance):", f"    adapter = {adapter!r}", ""]
        (tmp_path / "test_trainers.py").write_text("\n".join(lines))
        ids = [f"test_trainers.py::{cls}::{test}" for cls, names in tests.items() for test in names]
        return _run_conformance(tmp_path, ids, args)
    return run
