"""The suite against correct trainers in hostile environments (fixtures/hostile/, issue 53): each
ends within its deadline with the reference trainer's verdicts on the same checks, or with one
clear message where nothing can be judged, and leaves no process running.

Each runs the suite as a team does: `pytest --pyargs conformance` in a fresh interpreter, on a
small set of checks that starts the trainer, kills it and resumes it, with a stdin that never
ends (a terminal nobody types into). Every process it starts carries a token in its environment,
so those still running afterwards can be counted, and then ended. The reference trainer's verdicts
on the same checks come from one run of it per test session, shared by the test workers.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pkgutil
import re
import signal
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from filelock import FileLock, Timeout
from resume_conformance.fixtures import hostile
from resume_conformance.fixtures.hostile import exits_at_import, helper_writes_ckpt, stale_lock

from conformance.run.forkclient import ROOT_ENV

HOSTILE = "resume_conformance.fixtures.hostile"
REFERENCE = "resume_conformance.fixtures.reference_trainer:ADAPTER"
# Two uninterrupted runs (warm and fresh), a kill at a step boundary and the resume after it, a
# kill inside a save and the start after it.
START_KILL_RESUME = ("determinism_precondition", "resume_matches_baseline", "no_torn_state")
# A SIGTERM, ignored: the SIGKILL after the grace period, and the resume after it.
PREEMPTED = ("determinism_precondition", "preemption")
TOKEN_VAR = "HOSTILE_RUN_TOKEN"
# How long the processes of a suite that ended may take to go (its guardian ends what is left).
GONE_WITHIN_S = 10


@dataclasses.dataclass(frozen=True)
class Case:
    """One fixture: the checks it runs, its deadline, and what it must get (the reference trainer's
    verdicts, or, where `message` is given, failures whose every message has a line matching each pattern)."""

    module: str
    checks: tuple[str, ...] = START_KILL_RESUME
    # Several times what a working suite takes on a loaded 2-core machine; a hang costs all of it.
    deadline_s: float = 300
    options: tuple[str, ...] = ()
    message: tuple[str, ...] = ()
    console: tuple[str, ...] = ()      # what the suite's console output must also show

    @property
    def spec(self) -> str:
        return f"{HOSTILE}.{self.module}:ADAPTER"


# The stale lock: the trainer never logs a step, so it is cut by the limit without a step; a
# process timeout of 60 s makes that 30 s instead of the first run's 120 s (docs/running.md, "Time limits").
STALE_LOCK_OPTIONS = ("--process-timeout=60",)
THE_LOCK = "<the lock file>"   # stands for the lock file's path, which only the test knows
EXIT_STATUS = rf"(?:status|code|exited(?: with)?)\W{{0,3}}{exits_at_import.EXIT_STATUS}\b"
CASES = (
    Case("stdout_banner"),
    Case("stdout_binary"),
    Case("stdout_closed"),
    # A Python thread in the fork server makes it refuse to fork: every process runs fresh.
    Case("daemon_thread", deadline_s=420),
    Case("helper_process"),
    Case("helper_writes_ckpt", console=(re.escape(helper_writes_ckpt.STATE_FILE),)),
    # Each fresh interpreter imports the slow dependency again: 15 s per fresh process.
    Case("slow_import", deadline_s=420),
    Case("reads_stdin"),
    Case("stderr_flood", deadline_s=420),
    Case("new_session"),
    Case("ignores_sigterm", checks=PREEMPTED),
    Case("exits_at_import", checks=("determinism_precondition", "resume_matches_baseline"), deadline_s=180,
         message=(re.escape(exits_at_import.__name__), EXIT_STATUS)),
    Case("stale_lock", checks=("determinism_precondition", "resume_matches_baseline"), deadline_s=300,
         options=STALE_LOCK_OPTIONS, message=(THE_LOCK,)),
)


@dataclasses.dataclass
class SuiteRun:
    verdicts: dict[str, tuple[str, str]]    # test name -> (outcome, message), from the JUnit XML
    output: str                             # the console's stdout and stderr, interleaved
    wall_s: float
    ended: bool                             # within the deadline
    left_running: list[str]                 # "pid: cmdline" of the processes still there afterwards


def _verdicts(xml: Path) -> dict[str, tuple[str, str]]:
    verdicts = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                outcome, message = name, (el.get("message") or "") + "\n" + (el.text or "")
        verdicts[case.get("name")] = (outcome, message)
    return verdicts


def _carrying(token: str) -> dict[int, str]:
    """The processes whose environment carries the token: pid -> command line."""
    mark, found = f"{TOKEN_VAR}={token}".encode(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:   # gone meanwhile, or a zombie
            continue
    return found


def _still_running(token: str, within_s: float) -> dict[int, str]:
    """Those carrying the token after up to `within_s` for them to go."""
    deadline = time.monotonic() + within_s
    left = _carrying(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _carrying(token)
    return left


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_as_a_team(where: Path, spec: str, checks: tuple[str, ...], deadline_s: float, *options: str,
                  env: dict[str, str] | None = None) -> SuiteRun:
    """`pytest --pyargs conformance --adapter=SPEC -k CHECKS` in a fresh interpreter in `where`,
    ended (its process group, then every process carrying its token) if it runs past `deadline_s`."""
    where.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    assert not _carrying(token)
    # The harness's roots of fork servers are not a team's, and PYTEST_XDIST_* and PYTEST_CURRENT_TEST are this worker's.
    base = {k: v for k, v in os.environ.items()
            if k != ROOT_ENV and not k.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))}
    xml, log = where / "junit.xml", where / "console.txt"
    argv = [sys.executable, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-q",
            f"--junitxml={xml}", f"--basetemp={where / 'suite'}", "-W", "ignore::DeprecationWarning",
            f"--adapter={spec}", "--hypothesis-profile=conformance-quick", "-k", " or ".join(checks), *options]
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=where, env={**base, **(env or {}), TOKEN_VAR: token}, stdin=subprocess.PIPE,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=deadline_s)
            ended = True
        except subprocess.TimeoutExpired:
            ended = False
            os.killpg(proc.pid, signal.SIGKILL)
            _kill(_carrying(token))
            proc.wait(timeout=60)
        finally:
            proc.stdin.close()
    wall = time.monotonic() - start
    left = _still_running(token, GONE_WITHIN_S)
    _kill(left)
    output = log.read_bytes().decode(errors="replace")
    return SuiteRun(_verdicts(xml) if xml.exists() else {}, output, wall, ended, [f"{p}: {c[:200]}" for p, c in left.items()])


def _selected(name: str, checks: tuple[str, ...]) -> bool:
    return any(check in name for check in checks)


ALL_CHECKS = tuple(dict.fromkeys(c for case in CASES if not case.message for c in case.checks))


@pytest.fixture(scope="session")
def reference_outcomes(tmp_path_factory, worker_id):
    """reference_outcomes() -> {test name: outcome} of the reference trainer on every check a case
    runs, from one run per test session (under xdist: the first worker to ask runs it, the others
    wait for its file)."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent
    cache = shared / "hostile-reference-outcomes.json"

    def outcomes() -> dict[str, str]:
        lock = FileLock(str(cache) + ".lock")
        try:
            lock.acquire(timeout=900)   # the time one reference run may take (600 s), and more
        except Timeout:
            pytest.fail(f"waited 900 s for another test worker's run of the reference trainer ({cache})")
        try:
            if not cache.exists():
                run = run_as_a_team(shared / "hostile-reference", REFERENCE, ALL_CHECKS, 600)
                assert run.ended and run.verdicts, f"the reference trainer's run did not end:\n{run.output[-3000:]}"
                assert not run.left_running, run.left_running
                print(f"reference trainer: {run.wall_s:.0f} s")
                cache.write_text(json.dumps({name: v[0] for name, v in run.verdicts.items()}))
            return json.loads(cache.read_text())
        finally:
            lock.release()
    return outcomes


def _listing(verdicts: dict[str, tuple[str, str]]) -> str:
    return "\n\n".join(f"{name}: {outcome}: {message[:1500]}" for name, (outcome, message) in verdicts.items())


# Part C's fixture (a static file copied into each checkpoint) is judged by its own tests.
JUDGED_ELSEWHERE = {"copies_static_file"}


def test_every_hostile_fixture_has_a_case_and_a_row_in_the_docs(repo_root):
    modules = {m.name for m in pkgutil.iter_modules(hostile.__path__) if not m.name.startswith("_")} - JUDGED_ELSEWHERE
    assert modules == {case.module for case in CASES}
    table = (repo_root / "docs" / "fixtures.md").read_text().partition("## Hostile environments")[2]
    for name in sorted(modules):
        assert f"| `{name}` |" in table, f"docs/fixtures.md's hostile-environment table lacks {name}"
        module = importlib.import_module(f"{HOSTILE}.{name}")
        assert module.__doc__ and module.ADAPTER.argv[1:] == ("-m", module.__name__), name


@pytest.mark.slow
@pytest.mark.needs_strace
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.module)
def test_hostile_environment(case: Case, tmp_path, reference_outcomes, record_property):
    env, lock = {}, None
    if case.module == "stale_lock":
        lock = stale_lock.lock_path({stale_lock.LOCK_DIR_ENV: str(tmp_path / "torch_extensions")})
        lock.parent.mkdir(parents=True)
        lock.touch()   # as a process killed while it held the lock leaves it
        env[stale_lock.LOCK_DIR_ENV] = str(lock.parent)
    run = run_as_a_team(tmp_path, case.spec, case.checks, case.deadline_s, *case.options, env=env)
    record_property("wall_s", round(run.wall_s, 1))
    print(f"{case.module}: {run.wall_s:.0f} s")
    tail = run.output[-3000:]
    assert run.ended, f"the suite did not end within {case.deadline_s:.0f} s (it was killed):\n{tail}"
    assert run.verdicts, f"no verdicts (no JUnit XML) after {run.wall_s:.0f} s:\n{tail}"
    assert not run.left_running, f"processes left running after the suite ended: {run.left_running}"
    if case.message:
        patterns = [p.replace(THE_LOCK, re.escape(str(lock))) for p in case.message]
        assert not any(outcome == "passed" for outcome, _ in run.verdicts.values()), _listing(run.verdicts)
        failed = {name: message for name, (outcome, message) in run.verdicts.items() if outcome in ("failed", "error")}
        assert failed, _listing(run.verdicts)
        for name, message in failed.items():
            # One line says it all (the replay line names the adapter's module whatever happened).
            lines = [line for line in message.splitlines() if not line.strip().startswith("replay:")]
            assert any(all(re.search(p, line) for p in patterns) for line in lines), \
                f"{name}: no line of the message matches each of {patterns}:\n{message[:3000]}"
            assert "ServerDied" not in message and "Traceback (most recent call last)" not in message, \
                f"{name}: not one clear message:\n{message[:3000]}"
    else:
        expected = {name: outcome for name, outcome in reference_outcomes().items() if _selected(name, case.checks)}
        got = {name: outcome for name, (outcome, _) in run.verdicts.items()}
        assert got == expected, f"the reference trainer's verdicts: {expected}\n\n{_listing(run.verdicts)}"
    for pattern in case.console:
        assert re.search(pattern, run.output), f"the console output does not show {pattern!r}:\n{tail}"
