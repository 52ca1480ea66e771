"""A trainer process's lifecycle as the suite sees it: its own exit ends its run (what it left
running is recorded, ended, and never waited for by strace), a stall says what it waits on, and a
flood of stderr is kept as a bounded tail. Small processes stand in for trainers; the slow test at
the end runs the suite on a correct trainer that leaves a helper."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conformance.model import evidence
from conformance.model.process import RunSpec
from conformance.run import runners
from conformance.run.guardian import GUARD_VAR, marked
from conformance.run.proctree import exited
from conformance.run.watchdog import Limits, Watchdog
from conformance.trace.strace import record_argv, strace_problem

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
needs_strace = pytest.mark.skipif(strace_problem() is not None, reason=f"needs strace: {strace_problem()}")

SINGLE = RunSpec(total_steps=5, save_every=2, seed=0)
REPO = Path(__file__).resolve().parents[1]

# A helper that waits until the trainer that started it has exited (it is reparented), then
# appends to a file in the checkpoint directory every 50 ms: what a data server saving its own
# state there does, and what can race the next start. Its pid goes to stdout first.
WRITING_HELPER = textwrap.dedent("""
    import os, sys, time
    ckpt, parent = sys.argv[1], os.getppid()
    print(os.getpid(), flush=True)
    while os.getppid() == parent:
        time.sleep(0.01)
    while True:
        with open(os.path.join(ckpt, "helper.state"), "a") as f:
            f.write("x")
        time.sleep(0.05)
""")
# A helper that daemonizes (forks, its parent exits, it starts a session of its own) and writes
# nothing: a logging service. Reparented at once, it is never in the trainer's process tree.
QUIET_HELPER = ("import os, sys, time\nif os.fork():\n    os._exit(0)\nos.setsid()\nprint(os.getpid(), flush=True)\n"
                "sys.stdout.close()\ntime.sleep(600)")


def _trainer(helper: str, status: int) -> str:
    """A trainer that starts `helper`, passes on its pid line, trains a moment (0.3 s) and exits with
    `status` without waiting for it."""
    return (f"import subprocess, sys, time\nh = subprocess.Popen([sys.executable, '-c', {helper!r}, sys.argv[1]], "
            "stdout=subprocess.PIPE, text=True)\nprint(h.stdout.readline().strip(), flush=True)\ntime.sleep(0.3)\n"
            f"sys.exit({status})")


def _run(tmp_path: Path, code: str, *, traced: bool) -> tuple[subprocess.Popen, Watchdog, int, float]:
    """Run `code` as a fresh runner runs a trainer (its own session, strace first when `traced`),
    asking a watchdog every 50 ms, to its end and finish's sweep: (process, watchdog, the helper's
    pid, seconds to the end)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    trace = tmp_path / "run.strace"
    watch = Watchdog(Limits(total_s=60, stall_s=30), SINGLE, tmp_path / "loss.jsonl", [trace] if traced else [],
                     ckpt_dir=ckpt)
    argv = [*(record_argv(trace, data=False) if traced else []), sys.executable, "-c", code, str(ckpt)]
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=watch.env(dict(os.environ)), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    watch.follow(proc.pid)
    helper = int(proc.stdout.readline())
    try:
        while proc.poll() is None and time.monotonic() - start < 30:
            assert watch.problem() is None
            time.sleep(0.05)
        took = time.monotonic() - start
        watch.end_leftovers()
        watch.helpers.record([trace] if traced else [])
        ended = _ended(helper)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        try:
            os.kill(helper, 9)
        except ProcessLookupError:
            pass
    assert ended, f"the helper (pid {helper}) was left running"
    return proc, watch, helper, took


def _ended(pid: int, seconds: float = 10) -> bool:
    """Whether `pid` has exited within `seconds` (a SIGKILL is delivered as the process next runs)."""
    deadline = time.monotonic() + seconds
    while not exited(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return exited(pid)


def _helpers_left() -> evidence.HelpersLeft:
    found = [e for e in evidence.take() if isinstance(e, evidence.HelpersLeft)]
    assert len(found) == 1, found
    return found[0]


@needs_strace
def test_a_traced_trainer_that_exits_ends_its_run_and_its_helper_is_recorded_and_ended(tmp_path):
    """strace -f follows the helper: before, it waited for it (the run "hung at exit" for the stall
    limit, 30 s here). The trainer's own status (3) is the run's; the helper, which writes into
    the checkpoint directory once the trainer is gone, is ended and reported as racing the next start."""
    evidence.take()
    proc, _, helper, took = _run(tmp_path, _trainer(WRITING_HELPER, 3), traced=True)
    assert proc.returncode == 3, proc.returncode
    assert took < 15, took
    found = _helpers_left()
    assert (found.runs, found.count) == (1, 1)
    record = found.helpers[0]
    assert record.pid == helper and record.ended and "os.getppid() == parent" in record.command, record
    assert record.wrote_checkpoint and record.paths == ("helper.state",), record
    assert found.summary().startswith("WARNING: a helper process wrote under the checkpoint directory after its "
                                      "trainer exited"), found.summary()
    assert evidence.warnings() == []   # taken


def test_a_helper_in_a_session_of_its_own_is_found_by_the_runs_mark_and_ended(tmp_path):
    """Untraced: the trainer's exit is the run's end at once; its helper daemonized (reparented,
    setsid), out of the run's process tree before the watchdog ever sampled it: the run's mark
    finds it. (Before, nothing did: it ran on.)"""
    evidence.take()
    proc, watch, helper, took = _run(tmp_path, _trainer(QUIET_HELPER, 0), traced=False)
    assert proc.returncode == 0 and took < 10, (proc.returncode, took)
    found = _helpers_left()
    assert [(h.pid, h.wrote_checkpoint, h.ended) for h in found.helpers] == [(helper, False, True)], found
    assert not found.summary().startswith("WARNING") and "the suite ended those still running" in found.summary()
    assert not [p for p in marked(watch.mark) if not exited(p)]


def test_helpers_left_folds_per_test_and_survives_json():
    evidence.take()
    evidence.helpers_left((evidence.Helper(11, "python -c serve", False),))
    assert evidence.warnings() == []
    evidence.helpers_left((evidence.Helper(12, "python -c save", True, ("state",)), evidence.Helper(13, "x")),
                          ("other",))
    assert len(evidence.warnings()) == 1 and "state" in evidence.warnings()[0]
    [found] = evidence.take()
    assert (found.runs, found.count, found.helpers[0].pid, found.unattributed) == (2, 3, 12, ("other",))
    again = evidence.Evidence.from_json(json.loads(json.dumps(found.to_json())))
    assert again == found


def test_a_failure_repeats_the_warning_of_a_helper_that_wrote_after_its_trainer_exited():
    from conformance.checks.failures import ConformanceFailure
    from conformance.checks.registry import Check

    def run(session, check_id, spec, param, case):
        raise ConformanceFailure("[determinism_precondition] the runs differ")

    evidence.take()
    evidence.helpers_left((evidence.Helper(7, "python -c save", True, ("state",)),))
    try:
        with pytest.raises(ConformanceFailure) as failed:
            Check("determinism_precondition", "t", "s", run).decide(None, SINGLE)
    finally:
        evidence.take()
    assert "\n  warning:  WARNING: a helper process wrote under the checkpoint directory after its trainer exited" \
           in str(failed.value), str(failed.value)


def test_a_run_mark_is_the_suites_mark_and_one_of_its_own(tmp_path):
    """The guardian's match on the suite's mark covers every run's processes; a run's finds only its own."""
    watch = Watchdog(Limits(), SINGLE, tmp_path / "loss.jsonl", [])
    other = Watchdog(Limits(), SINGLE, tmp_path / "loss.jsonl", [])
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=watch.env(dict(os.environ)))
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in marked(watch.mark) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.pid in marked(watch.mark) and proc.pid in marked(os.environ[GUARD_VAR])
        assert proc.pid not in marked(other.mark)
    finally:
        proc.kill()
        proc.wait(timeout=10)


# -- a stall says what it waits on --------------------------------------------------------------------
def _stall(tmp_path: Path, code: str) -> str:
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        watch = Watchdog(Limits(total_s=60, stall_s=1.0), SINGLE, tmp_path / "loss.jsonl", [])
        watch.follow(proc.pid)
        deadline = time.monotonic() + 30
        while (problem := watch.problem()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return problem or ""
    finally:
        proc.kill()
        proc.wait(timeout=10)


@needs_strace
def test_a_process_waiting_on_a_stale_lock_file_is_said_to_wait_on_it(tmp_path):
    """torch's FileBaton: a process that finds the lock file polls os.path.exists every 0.1 s."""
    lock = tmp_path / "torch_extensions" / "fused_op" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    problem = _stall(tmp_path, f"import os, time\nprint('up', flush=True)\nwhile os.path.exists({str(lock)!r}): "
                               "time.sleep(0.1)")
    assert f"stalled before step 1, waiting on {lock} (in 1 s it checked " in problem, problem
    assert "times whether that file exists" in problem and "it exists" in problem, problem


def test_a_process_blocked_taking_a_lock_is_said_to_wait_on_its_file(tmp_path):
    import fcntl
    lock = tmp_path / "build.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        problem = _stall(tmp_path, f"import fcntl\nf = open({str(lock)!r}, 'w')\nprint('up', flush=True)\n"
                                   "fcntl.flock(f, fcntl.LOCK_EX)")
    assert f"stalled before step 1, waiting on {lock} (thread " in problem, problem
    assert "is blocked in flock on it, waiting for the lock on it to be released)" in problem, problem


@needs_strace
def test_a_process_that_only_sleeps_is_stalled_on_something_the_suite_cannot_tell(tmp_path):
    problem = _stall(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(600)")
    assert "stalled before step 1; the suite cannot tell what it waits on: it made no system call in 1 s; its main " \
           "thread was in clock_nanosleep" in problem, problem


# -- a flood of stderr --------------------------------------------------------------------------------
def test_a_flood_of_stderr_is_kept_as_a_bounded_tail_naming_the_file(tmp_path):
    path = tmp_path / "loss.jsonl.stderr"
    with open(path, "wb") as f:
        f.write(b"noise line\n" * (3 * runners.STDERR_KEPT // 11))
        f.write(b"Traceback (most recent call last):\nValueError: the real error\n")
    text = runners.stderr_text(path)
    assert len(text.encode()) <= runners.STDERR_KEPT + 200
    first, rest = text.split("\n", 1)
    assert first.startswith("[") and f"bytes of stderr left out: all {path.stat().st_size} are in {path}]" in first
    assert rest.startswith("noise line\n") and rest.endswith("ValueError: the real error\n")
    small = tmp_path / "small.stderr"
    small.write_bytes(b"just this\n")
    assert runners.stderr_text(small) == "just this\n"
    assert runners.stderr_text(tmp_path / "missing") == ""


# -- the suite on a trainer that leaves a helper ----------------------------------------------------------
HELPER_TRAINER = '''
"""The reference trainer, with a helper process started at import and never waited for."""
import subprocess
import sys

from resume_conformance.fixtures.reference_trainer import main

HELPER = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

if __name__ == "__main__":
    sys.exit(main())
'''
HELPER_ADAPTER = '''
import dataclasses
import sys

from resume_conformance.fixtures.reference_trainer import ADAPTER as REFERENCE

ADAPTER = dataclasses.replace(REFERENCE, name="leaves_helper", argv=(sys.executable, "-m", "leaves_helper"),
                              spec="leaves_helper_adapter:ADAPTER", pythonpath=({here!r},))
'''


@pytest.mark.slow
@needs_strace
def test_the_suite_passes_a_trainer_that_leaves_a_helper_and_leaves_nothing_running(tmp_path):
    """Before: "hung at exit ... made no progress for 326 s" in every check, strace waiting on the
    helper. Now: its verdicts within a deadline, the helpers in the report, none left running. The
    warm runner (its strace attaches: attach.Tracer); a fresh runner's strace (its trainer is
    strace's child) is the first test of this file."""
    (tmp_path / "leaves_helper.py").write_text(HELPER_TRAINER)
    (tmp_path / "leaves_helper_adapter.py").write_text(HELPER_ADAPTER.format(here=str(tmp_path)))
    mark = f"test-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           GUARD_VAR: mark}   # the suite's guard() marks its processes under this one's: all of them are found
    report = tmp_path / "report"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-q",
                           "--adapter=leaves_helper_adapter:ADAPTER", "-k", "determinism_precondition",
                           "--hypothesis-profile=conformance-quick", f"--conformance-report={report}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert took < 240, took
    cases = json.loads((report / "report.json").read_text())["cases"]
    assert any("helper process(es) outlived the trainer process" in json.dumps(c) for c in cases), cases
    deadline = time.monotonic() + 10   # the guardian ends what the suite's process left as it exits
    while (left := [p for p in marked(mark) if not exited(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [(p, Path(f"/proc/{p}/cmdline").read_bytes()) for p in left]
