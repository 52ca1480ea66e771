"""A run's processes as /proc shows them: the tree under a launched process, per thread its state,
the CPU time it used and the time it waited runnable for a CPU, and whether that is progress
(`progressed`); and how a whole tree is killed. The watchdog decides with it whether a job made
progress; where.py says where each process was when it did not."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class TaskSample:
    """One thread of one process of the job at one moment, from /proc/PID/task/TID: its state
    letter (stat), the CPU time it has used and the time it has spent runnable waiting for a CPU
    (schedstat, ns; where the kernel lacks schedstat: utime+stime, in ns, and no wait), and
    the read/write-type system calls it has made (io; -1 where unreadable), and its name."""

    pid: int
    tid: int
    state: str
    cpu: int
    waited: int = 0
    syscalls: int = -1
    name: str = ""


# D: waiting on a device (a slow disk is load, not a hang); t: stopped by its tracer (the suite's
# strace), which is the suite's own doing.
ACTIVE_STATES = frozenset("Dt")
# A thread is busy when CPU time plus run-queue wait make at least this share of the interval:
# threads that wake on a timer whatever the job does (gloo's transport loop in a rank blocked in a
# collective, a thread asking for the GIL) use a small fraction of that, and a thread that works,
# however starved, more (what each used: docs/benchmarks.md, "Measured by hand").
BUSY_SHARE = 0.25


def progressed(before: Mapping[int, TaskSample], after: Mapping[int, TaskSample], interval_s: float = 1.0) -> bool:
    """Whether the job made progress between two samples (tid -> TaskSample) of its threads,
    taken `interval_s` apart.

    The rule: it did if a thread appeared or vanished, or any thread was busy (BUSY_SHARE of the
    interval in CPU time plus run-queue wait), made a read or write system call, waits on a device
    (D) or is stopped by its tracer (t), or is starved: runnable (R) with both counters still
    (the kernel adds a wait to them only when the thread gets the CPU, so a thread that never does
    shows nothing else). So load alone never reads as a hang, and neither does a slow disk; a
    thread that only ticks over on a timer is no progress."""
    if before.keys() != after.keys():
        return True
    for tid, now in after.items():
        then = before[tid]
        used = now.cpu - then.cpu + now.waited - then.waited
        if used >= BUSY_SHARE * interval_s * 1e9 or now.state in ACTIVE_STATES or now.syscalls != then.syscalls:
            return True
        if now.state == "R" and used == 0:
            return True
    return False


def proc_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def stat_fields(text: str) -> tuple[str, list[str]]:
    """(comm, the fields after it) of a /proc stat line; comm may hold spaces and parentheses."""
    open_, close = text.find("("), text.rfind(")")
    return text[open_ + 1:close], text[close + 2:].split()


def start_time(pid: int) -> str:
    """When process `pid` started (clock ticks since boot; "" if it is gone): a pid reused by a new
    process has another."""
    stat = proc_text(f"/proc/{pid}/stat")
    return stat_fields(stat)[1][19] if stat else ""


def exited(pid: int) -> bool:
    """Whether process `pid` has ended: gone from /proc, or a zombie its parent has not reaped."""
    stat = proc_text(f"/proc/{pid}/stat")
    return not stat or stat_fields(stat)[1][0] in ("Z", "X")


PF_EXITING = 0x4   # a task's flag (/proc/PID/stat field 9) once it has begun to exit


def dying(pid: int) -> bool:
    """Whether process `pid` has ended or is on its way out: gone, a zombie, its main thread
    exiting, or a SIGKILL pending (one the suite just sent is delivered when it next runs)."""
    stat = proc_text(f"/proc/{pid}/stat")
    if not stat:
        return True
    fields = stat_fields(stat)[1]
    if fields[0] in ("Z", "X") or int(fields[6]) & PF_EXITING:
        return True
    for line in (proc_text(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (1 << (signal.SIGKILL - 1)):
            return True
    return False


def read_task(pid: int, tid: int) -> TaskSample | None:
    base = f"/proc/{pid}/task/{tid}"
    stat = proc_text(f"{base}/stat")
    if not stat:
        return None
    name, fields = stat_fields(stat)
    sched = (proc_text(f"{base}/schedstat") or "").split()
    if len(sched) >= 2:
        cpu, waited = int(sched[0]), int(sched[1])
    else:   # utime + stime, clock ticks to ns: coarser, same unit
        cpu, waited = (int(fields[11]) + int(fields[12])) * (10**9 // os.sysconf("SC_CLK_TCK")), 0
    io = dict(line.split(": ", 1) for line in (proc_text(f"{base}/io") or "").splitlines() if ": " in line)
    syscalls = int(io["syscr"]) + int(io["syscw"]) if "syscr" in io and "syscw" in io else -1
    return TaskSample(pid, tid, fields[0], cpu, waited, syscalls, name)


def _children(pid: int, tids: list[str]) -> list[int] | None:
    """The child processes of `pid` (from each thread's children file; None without that file)."""
    out: list[int] = []
    for tid in tids:
        text = proc_text(f"/proc/{pid}/task/{tid}/children")
        if text is None:
            return None
        out += [int(c) for c in text.split()]
    return out


def _ppids() -> dict[int, list[int]]:
    """parent -> children, from a scan of /proc (kernels without the children file)."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_text(f"/proc/{name}/stat")
            if stat:
                tree.setdefault(int(stat_fields(stat)[1][1]), []).append(int(name))
    return tree


def process_tree(root: int) -> list[int]:
    """`root` and every process below it, parents before children."""
    order, todo, seen, scan = [], [root], set(), None
    while todo:
        pid = todo.pop(0)
        if pid in seen:
            continue
        try:
            tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
        except OSError:
            continue
        seen.add(pid)
        order.append(pid)
        kids = _children(pid, tids)
        if kids is None:
            scan = scan if scan is not None else _ppids()
            kids = scan.get(pid, [])
        todo += kids
    return order


def kill_tree(pid: int, *, spare_tracers: bool = False) -> None:
    """SIGKILL `pid`, its process group and every process below it, wherever their groups and
    sessions are (torchrun's fresh ranks start sessions of their own): the tree is read before the
    first signal, so an orphan cannot escape it, and again until nothing of it is left. With
    `spare_tracers`, strace is left to report its tracee's death (a trace that ends with the kill)
    and exit by itself; its group is not signalled either."""
    for _ in range(3):
        alive = [each for each in process_tree(pid) if not exited(each)
                 and not (spare_tracers and comm(each) == "strace")]
        if not alive:
            return
        for each in alive:
            sigkill(each, group=each == pid and not spare_tracers)


def comm(pid: int) -> str:
    """A process's name (/proc/PID/comm; "" if it is gone)."""
    return (proc_text(f"/proc/{pid}/comm") or "").strip()


def sigkill(pid: int, group: bool = False) -> None:
    """SIGKILL `pid` (with `group`, its process group too); one already gone is no error."""
    if group:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def sample_tree(pids: list[int], skip: frozenset[int] = frozenset()) -> dict[int, TaskSample]:
    """tid -> TaskSample for every thread of `pids` but those of the processes in `skip`."""
    out: dict[int, TaskSample] = {}
    for pid in pids:
        if pid in skip:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            sample = read_task(pid, int(tid))
            if sample is not None:
                out[int(tid)] = sample
    return out


def tracers(pids: list[int]) -> list[int]:
    """The processes tracing any of `pids` (TracerPid in their status) that are not among them:
    the suite's straces of a warm run, which wait for a CPU like the trainer they stop."""
    found = []
    for pid in pids:
        tracer = tracer_of(pid)
        if tracer and tracer not in pids and tracer not in found:
            found.append(tracer)
    return found


def tracer_of(pid: int) -> int:
    """The pid of the process ptracing `pid` (0: none)."""
    for line in (proc_text(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith("TracerPid:"):
            return int(line.split()[1] or 0)
    return 0


def tracees(tracer: int) -> list[int]:
    """The live processes `tracer` ptraces (strace -f follows every process its tracee starts, and
    keeps following it once the tracee has exited). One scan of /proc."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != tracer and tracer_of(int(name)) == tracer and not exited(int(name)):
            found.append(int(name))
    return found


def parent_of(pid: int) -> int:
    """The parent of process `pid` (0 if it is gone)."""
    stat = proc_text(f"/proc/{pid}/stat")
    return int(stat_fields(stat)[1][1]) if stat else 0


def children(pid: int) -> list[int]:
    """The child processes of `pid` (live or not yet reaped)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids = _children(pid, tids)
    return kids if kids is not None else _ppids().get(pid, [])


def command_line(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ("" if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(os.fsdecode(arg) for arg in f.read().split(b"\0") if arg)
    except OSError:
        return ""


def open_paths(pid: int) -> list[str]:
    """The files process `pid` holds open (their paths as /proc shows them)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    paths = []
    for fd in fds:
        try:
            paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return paths


KILLED_EXIT_S = 10.0   # how long a process SIGKILLed may take to be reaped (the kernel frees its memory first)


def reap(proc: subprocess.Popen, seconds: float, what: str) -> int:
    """Wait for `proc` to exit, at most `seconds`; then SIGKILL it and wait KILLED_EXIT_S more. Its
    status; RuntimeError naming `what` if even the kill did not end it in time."""
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
    try:
        return proc.wait(timeout=KILLED_EXIT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} (pid {proc.pid}) had not exited {KILLED_EXIT_S:g} s after the SIGKILL the suite "
                           f"sent it {seconds:g} s after waiting began") from None
