"""What a job's processes are doing, read from /proc: per thread its state, the CPU time it used
and the time it waited runnable for a CPU, its last syscall, and its Python stack (py-spy). The
watchdog decides with it whether a job made progress, and says where each process was when it
did not."""
from __future__ import annotations

import dataclasses
import functools
import os
import platform
import shutil
import subprocess
from collections import Counter
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


# R: running or runnable (a starved task waits here); D: waiting on a device (a slow disk is load,
# not a hang); t: stopped by its tracer (the suite's strace), which is the suite's own doing.
ACTIVE_STATES = frozenset("RDt")
# Threads that wake on a timer whatever the job does: gloo's transport loop (about 2 ms of CPU a
# second in a rank blocked in a collective). They count only while busy (moving a collective's
# data): CPU time plus run-queue wait of at least BUSY_SHARE of the interval.
TIMER_THREADS = frozenset({"gloo_tcp_loop"})
BUSY_SHARE = 0.25


def progressed(before: Mapping[int, TaskSample], after: Mapping[int, TaskSample], interval_s: float = 1.0) -> bool:
    """Whether the job made progress between two samples (tid -> TaskSample) of its threads,
    taken `interval_s` apart.

    The rule: it did, unless every thread in both samples is the same, and none of them used CPU
    time, made a system call, waited on a run queue, or is now runnable (R), waiting on a device
    (D) or stopped by its tracer (t). A thread that makes a system call uses CPU time, so the CPU
    counter covers syscalls; a thread starved by a busy machine is R or accumulates run-queue wait,
    so load alone never reads as a hang. Threads appearing or vanishing is progress. A timer
    thread (TIMER_THREADS) counts only when busy; in doubt (a loaded machine delaying its wakeups)
    it reads as busy, so a hang is then left to the total time limit, never a slow job killed."""
    if before.keys() != after.keys():
        return True
    for tid, now in after.items():
        then = before[tid]
        if now.name in TIMER_THREADS:
            if now.cpu - then.cpu + now.waited - then.waited >= BUSY_SHARE * interval_s * 1e9:
                return True
        elif now.state in ACTIVE_STATES or (now.cpu, now.waited, now.syscalls) != (then.cpu, then.waited, then.syscalls):
            return True
    return False


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat_fields(text: str) -> tuple[str, list[str]]:
    """(comm, the fields after it) of a /proc stat line; comm may hold spaces and parentheses."""
    open_, close = text.find("("), text.rfind(")")
    return text[open_ + 1:close], text[close + 2:].split()


def exited(pid: int) -> bool:
    """Whether process `pid` has ended: gone from /proc, or a zombie its parent has not reaped."""
    stat = _read(f"/proc/{pid}/stat")
    return not stat or _stat_fields(stat)[1][0] in ("Z", "X")


def read_task(pid: int, tid: int) -> TaskSample | None:
    base = f"/proc/{pid}/task/{tid}"
    stat = _read(f"{base}/stat")
    if not stat:
        return None
    name, fields = _stat_fields(stat)
    sched = (_read(f"{base}/schedstat") or "").split()
    if len(sched) >= 2:
        cpu, waited = int(sched[0]), int(sched[1])
    else:   # utime + stime, clock ticks to ns: coarser, same unit
        cpu, waited = (int(fields[11]) + int(fields[12])) * (10**9 // os.sysconf("SC_CLK_TCK")), 0
    io = dict(line.split(": ", 1) for line in (_read(f"{base}/io") or "").splitlines() if ": " in line)
    syscalls = int(io["syscr"]) + int(io["syscw"]) if "syscr" in io and "syscw" in io else -1
    return TaskSample(pid, tid, fields[0], cpu, waited, syscalls, name)


def _children(pid: int, tids: list[str]) -> list[int] | None:
    """The child processes of `pid` (from each thread's children file; None without that file)."""
    out: list[int] = []
    for tid in tids:
        text = _read(f"/proc/{pid}/task/{tid}/children")
        if text is None:
            return None
        out += [int(c) for c in text.split()]
    return out


def _ppids() -> dict[int, list[int]]:
    """parent -> children, from a scan of /proc (kernels without the children file)."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _read(f"/proc/{name}/stat")
            if stat:
                tree.setdefault(int(_stat_fields(stat)[1][1]), []).append(int(name))
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
        status = _read(f"/proc/{pid}/status") or ""
        for line in status.splitlines():
            if line.startswith("TracerPid:"):
                tracer = int(line.split()[1] or 0)
                if tracer and tracer not in pids and tracer not in found:
                    found.append(tracer)
                break
    return found


# -- where a process was, for the message when it is killed ----------------------------------------
_SYSCALLS = {
    "x86_64": {0: "read", 1: "write", 2: "open", 3: "close", 7: "poll", 9: "mmap", 16: "ioctl", 17: "pread64",
               18: "pwrite64", 23: "select", 24: "sched_yield", 34: "pause", 35: "nanosleep", 43: "accept",
               44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 56: "clone", 59: "execve",
               61: "wait4", 62: "kill", 74: "fsync", 75: "fdatasync", 82: "rename", 128: "rt_sigtimedwait",
               130: "rt_sigsuspend", 202: "futex", 230: "clock_nanosleep", 232: "epoll_wait", 247: "waitid",
               257: "openat", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 288: "accept4", 435: "clone3",
               441: "epoll_pwait2"},
    "aarch64": {22: "epoll_pwait", 29: "ioctl", 56: "openat", 57: "close", 63: "read", 64: "write",
                67: "pread64", 68: "pwrite64", 72: "pselect6", 73: "ppoll", 82: "fsync", 83: "fdatasync",
                95: "waitid", 98: "futex", 101: "nanosleep", 115: "clock_nanosleep", 124: "sched_yield",
                129: "kill", 133: "rt_sigsuspend", 137: "rt_sigtimedwait", 202: "accept", 203: "connect",
                206: "sendto", 207: "recvfrom", 211: "sendmsg", 212: "recvmsg", 220: "clone", 221: "execve",
                242: "accept4", 260: "wait4", 435: "clone3", 441: "epoll_pwait2"},
}


@functools.cache
def syscall_name(number: int) -> str:
    """The name of a system call number on this machine: a small table of the usual blocking
    calls, else `ausyscall` where it is installed, else `syscall N`."""
    name = _SYSCALLS.get(platform.machine(), {}).get(number)
    if name is None and shutil.which("ausyscall"):
        try:
            out = subprocess.run(["ausyscall", str(number)], check=False, capture_output=True, text=True,
                                 timeout=2).stdout
            name = out.split()[0] if out.split() else None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return name or f"syscall {number}"


def last_syscall(pid: int, tid: int) -> str:
    """What /proc/PID/task/TID/syscall says the thread is doing: a syscall's name, `running`, or
    `not in a syscall`."""
    text = (_read(f"/proc/{pid}/task/{tid}/syscall") or "").split()
    if not text:
        return "unknown"
    if text[0] == "running":
        return "running"
    if text[0] == "-1":
        return "not in a syscall"
    return syscall_name(int(text[0])) if text[0].isdigit() else text[0]


def _traced(pid: int) -> bool:
    status = _read(f"/proc/{pid}/status") or ""
    return any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in status.splitlines())


STACK_FRAMES = 12   # innermost frames kept per thread


def python_stack(pid: int, timeout: float = 5.0) -> str | None:
    """`py-spy dump` of a Python process, or None: py-spy missing, the process not Python, or
    already ptraced (strace holds it) or gone."""
    exe = shutil.which("py-spy")
    if exe is None or _traced(pid) or "python" not in os.path.basename(os.path.realpath(f"/proc/{pid}/exe")):
        return None
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], check=False, capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    kept: list[str] = []
    frames = 0
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        if line.startswith("Thread "):   # each thread: its innermost frames (py-spy's header dropped)
            kept.append(line)
            frames = 0
        elif kept and line.strip():
            frames += 1
            if frames <= STACK_FRAMES:
                kept.append(line)
            elif frames == STACK_FRAMES + 1:
                kept.append("    ...")
    return "\n".join(kept) or None


def where(pids: list[int], *, stacks: bool = True) -> str:
    """One paragraph per process: its state, where its main thread waits (last syscall and
    wchan), what its other threads wait in, and its Python stack (py-spy) when it can be read."""
    lines = []
    for pid in pids:
        stat = _read(f"/proc/{pid}/stat")
        if not stat:
            continue
        comm, fields = _stat_fields(stat)
        wchan = (_read(f"/proc/{pid}/wchan") or "").strip()
        wchan = f", wchan {wchan}" if wchan and wchan != "0" else ""
        try:
            tids = sorted((int(t) for t in os.listdir(f"/proc/{pid}/task")), key=lambda t: (t != pid, t))
        except OSError:
            tids = [pid]
        others = Counter(last_syscall(pid, t) for t in tids if t != pid)
        rest = ", ".join(f"{n} in {name}" if n > 1 else name for name, n in others.most_common())
        lines.append(f"    pid {pid} ({comm}, state {fields[0]}): main thread in {last_syscall(pid, pid)}{wchan}"
                     + (f"; {len(tids) - 1} other thread(s): {rest}" if others else ""))
        stack = python_stack(pid) if stacks else None
        if stack:
            lines += [f"      {line}" for line in stack.splitlines() if line.strip()][:60]
    return "\n".join(lines)
