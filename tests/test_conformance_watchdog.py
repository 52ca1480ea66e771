"""The watchdog's "no progress": a process tree that neither runs, makes a system call, nor waits
for a CPU (read from /proc), and no new logged step; never mere load."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.model.process import RunSpec
from conformance.run.watchdog import Limits, Stop, TaskSample, Watchdog, progressed, syscall_name

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")

SINGLE = RunSpec(total_steps=5, save_every=2, seed=0)
JOB = RunSpec(total_steps=5, save_every=2, seed=0, world_size=2)


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            text=True)


def _watch(watch: Watchdog, seconds: float) -> tuple[str | None, float]:
    """Ask the watchdog every 50 ms, as the runners do: (its problem or None, seconds it took)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        problem = watch.problem()
        if problem:
            return problem, time.monotonic() - start
        time.sleep(0.05)
    return None, seconds


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def _ready(proc: subprocess.Popen) -> str:
    """The child's first line (written once it has set itself up)."""
    return proc.stdout.readline().strip()


# -- progressed(): the rule, on fake /proc samples ------------------------------------------------
def _tasks(*samples: TaskSample) -> dict[int, TaskSample]:
    return {s.tid: s for s in samples}


def test_threads_that_all_sleep_unchanged_made_no_progress():
    before = _tasks(TaskSample(10, 10, "S", cpu=500, waited=7, syscalls=3), TaskSample(10, 11, "S", 80, 0, 3))
    assert not progressed(before, dict(before))


@pytest.mark.parametrize("after", [
    TaskSample(10, 11, "S", cpu=300_000_080, waited=0, syscalls=3),   # worked: used a share of the interval
    TaskSample(10, 11, "S", cpu=80, waited=0, syscalls=4),            # made a read/write syscall
    TaskSample(10, 11, "R", cpu=80, waited=0, syscalls=3),            # starved: runnable, no CPU to be had
    TaskSample(10, 11, "S", cpu=1_000_080, waited=299_000_000, syscalls=3),   # worked, starved between samples
    TaskSample(10, 11, "D", cpu=80, waited=0, syscalls=3),            # waiting on a (slow) device
    TaskSample(10, 11, "t", cpu=80, waited=0, syscalls=3),            # held by its tracer (the suite's strace)
], ids=["cpu", "syscall", "runnable", "waited", "device", "traced"])
def test_any_sign_of_work_or_of_starvation_is_progress(after):
    main = TaskSample(10, 10, "S", 500, 7, 3)
    assert progressed(_tasks(main, TaskSample(10, 11, "S", 80, 0, 3)), _tasks(main, after), 1.0)


def test_a_thread_waiting_for_the_gil_is_no_progress():
    """A rank hung at exit (its main thread joins a gloo worker while holding the GIL; the worker
    waits for the GIL): the worker wakes every 5 ms to ask for it, about 4 ms of CPU a second, and
    is sometimes caught runnable (measured on a real hang: 8 ms of CPU and 0.1 ms of wait in 2 s)."""
    main = TaskSample(10, 10, "S", 500, 7, 3, "python3")
    waiter = TaskSample(10, 13, "S", 10_000_000, 200_000, 3, "pt_gloo_runloop")
    polled = TaskSample(10, 13, "R", 18_000_000, 300_000, 3, "pt_gloo_runloop")
    assert not progressed(_tasks(main, waiter), _tasks(main, polled), 2.0)


def test_a_thread_or_process_appearing_or_vanishing_is_progress():
    a, b = TaskSample(10, 10, "S", 5), TaskSample(12, 12, "S", 5)
    assert progressed(_tasks(a), _tasks(a, b))
    assert progressed(_tasks(a, b), _tasks(a))


def test_gloos_transport_loop_ticking_over_is_not_progress_but_moving_data_is():
    """A rank blocked in a collective: gloo's loop thread wakes on a timer (about 2 ms of CPU and
    some run-queue wait a second, measured), which says nothing; near a full core it is moving data."""
    main = TaskSample(10, 10, "S", 500, 7, 3, "python3")
    idle = TaskSample(10, 12, "S", 1_000_000, 0, 3, "gloo_tcp_loop")
    assert not progressed(_tasks(main, idle), _tasks(main, TaskSample(10, 12, "R", 3_000_000, 40_000_000, 3,
                                                                      "gloo_tcp_loop")), 1.0)
    assert progressed(_tasks(main, idle), _tasks(main, TaskSample(10, 12, "S", 700_000_000, 0, 3, "gloo_tcp_loop")),
                      1.0)


def test_a_starved_trainer_is_never_declared_stalled(tmp_path, monkeypatch):
    """A machine so busy the trainer gets no CPU at all: it stays R, its counters still."""
    import conformance.run.watchdog as wd
    monkeypatch.setattr(wd, "process_tree", lambda root: [root])
    monkeypatch.setattr(wd, "sample_tree", lambda pids, skip=frozenset(): _tasks(TaskSample(pids[0], pids[0], "R", 9)))
    watch = Watchdog(Limits(total_s=30, stall_s=0.5), SINGLE, tmp_path / "loss.jsonl", [])
    watch.follow(424242)
    problem, _ = _watch(watch, 1.5)
    assert problem is None


def test_syscall_numbers_have_names():
    import platform
    if platform.machine() != "x86_64":
        pytest.skip("table checked on x86_64")
    assert (syscall_name(202), syscall_name(0), syscall_name(230)) == ("futex", "read", "clock_nanosleep")


# -- real processes --------------------------------------------------------------------------------
def _watch_child(tmp_path, children, code: str, seconds: float):
    """Start `code` in a child, follow it with a 1 s stall limit for `seconds`: (problem, took)."""
    children.append(proc := _child(code))
    _ready(proc)
    watch = Watchdog(Limits(total_s=30, stall_s=1.0), SINGLE, tmp_path / "loss.jsonl", [])
    watch.follow(proc.pid)
    return _watch(watch, seconds)


def test_a_sleeping_process_that_logs_nothing_is_stalled(tmp_path, children):
    problem, took = _watch_child(tmp_path, children, "import time; print('up', flush=True); time.sleep(60)", 8)
    assert problem and problem.startswith("made no progress for 1 s before logging any step"), problem
    assert took < 5


def test_a_process_burning_cpu_without_logging_is_not_stalled(tmp_path, children):
    problem, _ = _watch_child(tmp_path, children, "import time\nprint('up', flush=True)\nwhile True: pass", 3)
    assert problem is None


def test_logged_steps_still_count_as_progress(tmp_path, children):
    """The process sleeps throughout; its log grows (written here): not stalled until it stops."""
    children.append(proc := _child("import time; print('up', flush=True); time.sleep(60)"))
    _ready(proc)
    log = tmp_path / "loss.jsonl"
    watch = Watchdog(Limits(total_s=30, stall_s=1.0), SINGLE, log, [])
    watch.follow(proc.pid)
    for step in range(1, 6):
        with open(log, "a") as f:
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
        assert _watch(watch, 0.6)[0] is None
    problem, _ = _watch(watch, 5)
    # Step 5 is its last (SINGLE's total): logged, then neither progress nor an exit.
    assert problem and problem.startswith("hung at exit: it logged its last step, then made no progress for 1 s "
                                          "after step 5"), problem


def test_the_kill_message_says_where_each_process_of_a_job_was(tmp_path, children):
    """A job whose agent polls (CPU time that is no sign of training) over a rank blocked in a
    read: stalled, and the message names each process with its last system call."""
    rank = "import os\nr, w = os.pipe()\nos.read(r, 1)"
    agent = ("import subprocess, sys, time\n"
             f"rank = subprocess.Popen([sys.executable, '-c', {rank!r}])\n"
             "print(rank.pid, flush=True)\n"
             "while True: time.sleep(0.005)")
    children.append(proc := _child(agent))
    rank_pid = int(_ready(proc))
    time.sleep(0.3)   # the rank's interpreter starts, then blocks
    watch = Watchdog(Limits(total_s=30, stall_s=1.0, job_stall_s=1.0), JOB, tmp_path / "loss.jsonl", [])
    watch.follow(proc.pid)
    try:
        problem, _ = _watch(watch, 12)
    finally:
        os.kill(rank_pid, signal.SIGKILL)
    assert problem and problem.startswith("made no progress for 1 s before logging any step"), problem
    lines = watch.details.splitlines()   # where each process was, kept for the failure's details
    agent_line = next(line for line in lines if f"pid {proc.pid} (" in line)
    rank_line = next(line for line in lines if f"pid {rank_pid} (" in line)
    assert "main thread in read" in rank_line, watch.details
    assert any(name in agent_line for name in ("nanosleep", "running", "not in a syscall")), watch.details


def test_log_lines_are_read_as_before(tmp_path):
    log = tmp_path / "loss.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    watch = Watchdog(Limits(total_s=30, stall_s=30), SINGLE, log, [])
    assert watch.problem() is None and watch.last_step == 3


# -- the grace period after a signal, counted in time the run could use -----------------------------
def _pinned(code: str, cpu: int) -> str:
    return f"import os\nos.sched_setaffinity(0, {{{cpu}}})\n" + code


def _grace_watch(tmp_path, children, trainer: str, grace_s: float, seconds: float):
    """`trainer` and three CPU burners pinned to one CPU; the watchdog is told (by a trace line)
    that SIGTERM arrived once the trainer is up. (problem or None, seconds it took, the trainer)."""
    cpu = min(os.sched_getaffinity(0))
    for _ in range(3):
        children.append(_child(_pinned("print('up', flush=True)\nwhile True: pass", cpu)))
        _ready(children[-1])
    children.append(proc := _child(_pinned(trainer, cpu)))
    _ready(proc)
    trace = tmp_path / "trace.txt"
    trace.write_text(f"{proc.pid} --- SIGTERM {{si_signo=SIGTERM}} ---\n")
    watch = Watchdog(Limits(total_s=60, stall_s=30), SINGLE, tmp_path / "loss.jsonl", [trace],
                     stop=Stop(grace_s=grace_s))
    watch.follow(proc.pid)
    start = time.monotonic()
    while time.monotonic() - start < seconds and proc.poll() is None:
        if problem := watch.problem():
            return problem, time.monotonic() - start, proc
        time.sleep(0.05)
    return None, time.monotonic() - start, proc


def test_a_starved_trainer_that_needs_less_cpu_than_the_grace_is_not_killed(tmp_path, children):
    """0.6 s of CPU after the signal, a 2 s grace, at most a quarter of one CPU: 2.4 s of wall time or
    more, allowed (up to the 4x cap: 8 s, a thirteenth of the CPU, which a test run beside a
    load-4 soak once came close to with 1 s of CPU)."""
    busy = "import time\nprint('up', flush=True)\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"
    problem, took, proc = _grace_watch(tmp_path, children, busy, grace_s=2.0, seconds=30)
    assert problem is None, problem
    assert proc.returncode == 0 and took > 2.0, (proc.returncode, took)   # it did outlast the wall-clock grace


def test_a_trainer_that_sleeps_past_the_grace_is_killed_on_time_however_busy_the_machine(tmp_path, children):
    problem, took, _ = _grace_watch(tmp_path, children, "import time\nprint('up', flush=True)\ntime.sleep(60)",
                                    grace_s=1.0, seconds=30)
    assert problem and "still running at the end of the grace period" in problem, problem
    assert took < 4, took
