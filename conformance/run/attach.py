"""Attaching strace to a process that is already running (the warm runner's forked trainers and
ranks), and waiting until it is attached before the process goes on.

Letting go of it once that process has exited (`Tracer.release`): strace -f follows the processes
its tracee starts, and would wait for a helper the trainer left running for as long as it runs."""
from __future__ import annotations

import ctypes
import functools
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .proctree import exited, kill_tree, reap, tracees

# How long strace may take to write the end of its trace and exit once nothing it traces is left.
TRACER_EXIT_S = 30.0
# How long strace may take to say it attached to a running process (a loaded machine: seconds).
ATTACH_S = 120.0
# How long the attaching thread of a warm job may take to notice it is to stop (it polls every ms,
# and an attach in progress ends in strace's first line).
ATTACHER_STOP_S = 30.0

_PR_SET_PTRACER = 0x59616D61   # Yama


def allow_tracer(pid: int | None) -> None:
    """Let process `pid` and its descendants ptrace this one (Yama's PR_SET_PTRACER): where
    ptrace_scope is 1, the Ubuntu and GitHub-runner default, only an ancestor may attach, and the
    suite's strace is not this process's ancestor. A kernel without Yama refuses the call; then
    nothing needed it."""
    if pid:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PTRACER, pid, 0, 0, 0)


# Given the processes a tracer still follows once its tracee has exited: ends them.
OnLeft = Callable[[list[int]], None]


def _end_all(pids: list[int]) -> None:
    for pid in pids:
        kill_tree(pid)


class Tracer:
    """strace attached to a running process (`attach_strace`). Once that process has exited,
    `release()` hands what strace still follows (helpers the process left running) to `on_left`,
    which ends them (default: SIGKILL), and then waits for strace, which exits once nothing it
    traces is left, its trace complete (TRACER_EXIT_S at most; then it is killed)."""

    def __init__(self, proc: subprocess.Popen, traced: int, on_left: OnLeft | None = None):
        self.proc, self.traced, self.on_left = proc, traced, on_left
        self.released = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if not exited(self.traced):   # the request failed with it still running: strace detaches (SIGTERM)
            self.proc.terminate()
        else:
            left = [p for p in tracees(self.proc.pid) if p != self.traced]
            if left:
                (self.on_left or _end_all)(left)
        reap(self.proc, TRACER_EXIT_S, f"strace tracing pid {self.traced}, once nothing it traced was left,")

    def kill(self) -> None:
        self.proc.kill()


def attach_strace(prefix: list[str], pid: int, on_left: OnLeft | None = None) -> Tracer:
    """Start strace on an existing (blocked) process and return once it is attached."""
    args = [a for a in prefix if a not in ("-qq", "--", "--seccomp-bpf")] + ["-p", str(pid)]
    tracer = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen, deadline = b"", time.monotonic() + ATTACH_S
    while b"attached" not in seen:
        ready = select.select([tracer.stderr], [], [], max(0.0, deadline - time.monotonic()))[0]
        chunk = os.read(tracer.stderr.fileno(), 4096) if ready else b""
        if not chunk:   # strace exited (or is exiting) without attaching, or took too long
            tracer.kill()
            reap(tracer, TRACER_EXIT_S, f"strace that could not attach to pid {pid}")
            said = seen.decode(errors="replace")[-500:]
            raise RuntimeError(f"strace could not attach to {pid}: {said}" if ready else
                               f"strace had not attached to {pid} {ATTACH_S:g} s after it started: {said}")
        seen += chunk
    threading.Thread(target=tracer.stderr.read, daemon=True).start()   # what it writes later: drained
    return Tracer(tracer, pid, on_left)


@functools.cache
def attach_problem() -> str | None:
    """None if strace can attach to a running process of this user that allowed this process's
    descendants to (allow_tracer), as the warm runner's tracing does; else why not (Yama's
    ptrace_scope 2 or 3, a container without CAP_SYS_PTRACE, a seccomp profile). Probed with one
    real attach."""
    if shutil.which("strace") is None:
        return "strace is not installed"
    code = (f"import ctypes, sys; ctypes.CDLL(None).prctl({_PR_SET_PTRACER}, int(sys.argv[1]), 0, 0, 0); "
            "print('ready', flush=True); sys.stdin.read()")
    target = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    tracer = None
    try:
        target.stdout.readline()
        tracer = attach_strace(["strace", "-o", os.devnull], target.pid)
        return None
    except RuntimeError as exc:
        return " ".join(str(exc).split())
    finally:
        target.kill()
        reap(target, TRACER_EXIT_S, "the process the attach probe traced")
        if tracer is not None:
            tracer.release()


def announce_pid(directory: Path, rank: int, pid: int) -> None:
    """A warm rank tells the suite its pid (to attach strace to, and to say which process is which
    rank): written whole (temp name, then rename), since `RankAttacher` reads the file as soon as
    the name exists."""
    tmp = directory / f".rank{rank}.tmp"
    tmp.write_text(str(pid))
    os.replace(tmp, directory / f"rank{rank}")


def announced(directory: Path | None) -> dict[int, int]:
    """pid -> rank of each warm rank that announced its pid in `directory`."""
    found: dict[int, int] = {}
    for path in directory.glob("rank*") if directory is not None else ():
        try:
            found[int(path.read_text())] = int(path.name[len("rank"):])
        except (OSError, ValueError):
            continue
    return found


class RankAttacher:
    """Warm jobs: as each traced rank announces its pid (`announce_pid`), attach its strace and
    release it. `start()` returns this object, which the fork server client releases like a single
    Tracer once the job has ended (`release`: what each strace still follows goes to `on_left`)."""

    def __init__(self, directory: Path, straces: dict[int, list[str]], on_left: OnLeft | None = None):
        self.directory, self.straces, self.on_left = directory, straces, on_left
        self.go: dict[int, int] = {}
        for r in straces:
            fifo = directory / f"go.rank{r}"
            os.mkfifo(fifo)
            self.go[r] = os.open(fifo, os.O_RDWR)   # never blocks; the rank opens the read end
        self.tracers: list[Tracer] = []
        self.error: BaseException | None = None
        self.gone: list[int] = []   # ranks that ended before strace could attach
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> RankAttacher:
        if self.straces:
            self._thread.start()
        return self

    def _loop(self) -> None:
        pending = set(self.straces)
        while pending and not self._done.is_set():
            for r in sorted(pending):
                path = self.directory / f"rank{r}"
                if not path.exists():
                    continue
                pid = int(path.read_text())
                try:
                    self.tracers.append(attach_strace(self.straces[r], pid, self.on_left))
                except BaseException as exc:
                    if not exited(pid):   # the rank stays blocked; the job's watchdog ends it
                        self.error = exc
                        return
                    # It ended before its trace began (its agent stopped it: a peer had died
                    # first). Its missing trace is the run's outcome, for the check to judge.
                    self.gone.append(r)
                os.write(self.go[r], b"g")
                pending.discard(r)
            time.sleep(0.001)

    def problem(self) -> str | None:
        """Why the job must be stopped now: a rank's strace could not attach (the rank waits for ever)."""
        if self.error is None:
            return None
        return f"the suite could not attach strace to a rank: {self.error}"

    def _stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(ATTACHER_STOP_S)
            if self._thread.is_alive():
                raise RuntimeError(f"the thread attaching strace to a warm job's ranks had not stopped "
                                   f"{ATTACHER_STOP_S:g} s after it was asked to")

    def release(self) -> None:
        """The job has ended: stop attaching, and release every rank's strace (Tracer.release)."""
        self._stop()
        for tracer in self.tracers:
            tracer.release()

    def kill(self) -> None:
        self._done.set()
        for tracer in self.tracers:
            tracer.kill()

    def close(self) -> None:
        try:
            self.release()
        finally:
            for fd in self.go.values():
                os.close(fd)
            self.go.clear()
