"""Where each process of a run was when it had to be stopped, for the message that says so: per
process its state and each thread's last system call, which process is which rank, and the
trainer's Python and native stacks (py-spy), or the kernel's where py-spy is missing."""
from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping

from .proctree import proc_text, sigkill, stat_fields, tracer_of


def log_holders(pids: list[int], logs: list) -> dict[int, int]:
    """pid -> index into `logs` of each process that holds one of those files open (a rank keeps
    its loss log open: that tells which process is which rank)."""
    wanted = {os.path.realpath(str(log)): i for i, log in enumerate(logs)}
    found: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in wanted:
                found[pid] = wanted[target]
                break
    return found


def environ_ranks(pids: list[int]) -> dict[int, int]:
    """pid -> RANK of each process started with RANK in its environment (torchrun's fresh ranks;
    a forked rank's environment is set after its start and does not show here)."""
    found: dict[int, int] = {}
    for pid in pids:
        env = _read_bytes(f"/proc/{pid}/environ") or b""
        for item in env.split(b"\0"):
            if item.startswith(b"RANK=") and item[5:].isdigit():
                found[pid] = int(item[5:])
    return found


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


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
    text = (proc_text(f"/proc/{pid}/task/{tid}/syscall") or "").split()
    if not text:
        return "unknown"
    if text[0] == "running":
        return "running"
    if text[0] == "-1":
        return "not in a syscall"
    return syscall_name(int(text[0])) if text[0].isdigit() else text[0]


STACK_FRAMES = 16   # innermost frames kept per thread
FRAME_CHARS = 160   # a C++ frame names every template argument: cut
# The warm runner's own frames, below the trainer's: a fresh interpreter's stack has none of them.
HARNESS_FRAMES = ("conformance/run/", "<frozen runpy>")
PY_SPY_MISSING = ("py-spy is not installed, so no Python or native stack: `pip install py-spy` (the suite's "
                  "'diagnose' extra) adds each thread's stack to this message")


def py_spy() -> str | None:
    """py-spy on PATH or beside this interpreter (a venv not activated), or None."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)


def release_from_tracer(pid: int) -> None:
    """SIGKILL the strace holding `pid`, which detaches it (strace never asks the kernel to kill
    its tracees with it), so py-spy can attach: only for a process that is about to be killed."""
    tracer = tracer_of(pid)
    if tracer:
        sigkill(tracer)
        for _ in range(100):
            if not tracer_of(pid):
                return
            time.sleep(0.01)


def python_stack(pid: int, timeout: float = 10.0) -> str | None:
    """`py-spy dump --native` of a Python process (each thread's Python frames interleaved with its
    C and C++ ones), its innermost frames per thread; None when it cannot be read (py-spy missing,
    not a Python process, ptrace refused, gone)."""
    exe = py_spy()
    if exe is None or tracer_of(pid) or "python" not in os.path.basename(os.path.realpath(f"/proc/{pid}/exe")):
        return None
    try:
        out = subprocess.run([exe, "dump", "--native", "--pid", str(pid)], check=False, capture_output=True,
                             text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    kept: list[str] = []
    frames = 0
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        if line.startswith("Thread "):   # each thread: its innermost frames (py-spy's header dropped)
            kept.append(line)
            frames = 0
        elif kept and line.strip() and not any(harness in line for harness in HARNESS_FRAMES):
            frames += 1
            if frames <= STACK_FRAMES:
                kept.append(line if len(line) <= FRAME_CHARS else line[:FRAME_CHARS] + " ...")
            elif frames == STACK_FRAMES + 1:
                kept.append("    ...")
    return "\n".join(kept) or None


def kernel_stacks(pid: int, frames: int = 4) -> list[str]:
    """Where each thread of `pid` waits in the kernel (/proc/PID/task/TID/stack, readable by root),
    innermost frames first: what is left when no Python stack can be read."""
    lines = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return lines
    for tid in tids:
        stack = proc_text(f"/proc/{pid}/task/{tid}/stack")
        name = (proc_text(f"/proc/{pid}/task/{tid}/comm") or "").strip()
        if stack:
            top = [entry.split("]", 1)[-1].strip().split("+")[0] for entry in stack.splitlines()[:frames]]
            lines.append(f"thread {tid} ({name}, {last_syscall(pid, tid)}): " + " <- ".join(top))
    return lines


def where(pids: list[int], *, stacks: bool = True, detail: frozenset[int] | None = None,
          labels: Mapping[int, str] | None = None) -> str:
    """One paragraph per process (named by `labels` where given: "rank 1"): its state, where its
    main thread waits (last syscall and wchan), what its other threads wait in, and, for the
    processes in `detail` (default: all), its threads' Python and native stacks (py-spy), or
    without py-spy their kernel stacks."""
    lines = []
    for pid in pids:
        stat = proc_text(f"/proc/{pid}/stat")
        if not stat:
            continue
        comm, fields = stat_fields(stat)
        wchan = (proc_text(f"/proc/{pid}/wchan") or "").strip()
        wchan = f", wchan {wchan}" if wchan and wchan != "0" else ""
        try:
            tids = sorted((int(t) for t in os.listdir(f"/proc/{pid}/task")), key=lambda t: (t != pid, t))
        except OSError:
            tids = [pid]
        others = Counter(last_syscall(pid, t) for t in tids if t != pid)
        rest = ", ".join(f"{n} in {name}" if n > 1 else name for name, n in others.most_common())
        role = f"{labels[pid]}: " if labels and pid in labels else ""
        lines.append(f"    {role}pid {pid} ({comm}, state {fields[0]}): main thread in {last_syscall(pid, pid)}{wchan}"
                     + (f"; {len(tids) - 1} other thread(s): {rest}" if others else ""))
        if not stacks or (detail is not None and pid not in detail):
            continue
        stack = python_stack(pid)
        shown = stack.splitlines() if stack else kernel_stacks(pid)
        lines += [f"      {line}" for line in shown if line.strip()][:80]
    return "\n".join(lines)
