"""Attaching strace to a process that is already running (the warm runner's forked trainers and
ranks), and waiting until it is attached before the process goes on."""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from .proctree import exited

_PR_SET_PTRACER = 0x59616D61   # Yama


def allow_tracer(pid: int | None) -> None:
    """Let process `pid` and its descendants ptrace this one (Yama's PR_SET_PTRACER): where
    ptrace_scope is 1, the Ubuntu and GitHub-runner default, only an ancestor may attach, and the
    suite's strace is not this process's ancestor. A kernel without Yama refuses the call; then
    nothing needed it."""
    if pid:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PTRACER, pid, 0, 0, 0)


def attach_strace(prefix: list[str], pid: int) -> subprocess.Popen:
    """Start strace on an existing (blocked) process and return once it is attached."""
    args = [a for a in prefix if a not in ("-qq", "--", "--seccomp-bpf")] + ["-p", str(pid)]
    tracer = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    seen = []
    for line in tracer.stderr:
        seen.append(line)
        if "attached" in line:
            break
    else:
        tracer.wait()
        raise RuntimeError(f"strace could not attach to {pid}: {''.join(seen)[-500:]}")
    threading.Thread(target=tracer.stderr.read, daemon=True).start()
    return tracer


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
        target.wait()
        if tracer is not None:
            tracer.wait()


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
    release it. `start()` returns this object, which the fork server client waits on like a
    single strace (`wait`, `kill`)."""

    def __init__(self, directory: Path, straces: dict[int, list[str]]):
        self.directory, self.straces = directory, straces
        self.go: dict[int, int] = {}
        for r in straces:
            fifo = directory / f"go.rank{r}"
            os.mkfifo(fifo)
            self.go[r] = os.open(fifo, os.O_RDWR)   # never blocks; the rank opens the read end
        self.tracers: list[subprocess.Popen] = []
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
                    self.tracers.append(attach_strace(self.straces[r], pid))
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

    def wait(self, timeout: float | None = None) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for tracer in self.tracers:
            try:
                tracer.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                tracer.kill()

    def kill(self) -> None:
        self._done.set()
        for tracer in self.tracers:
            tracer.kill()

    def close(self) -> None:
        self.wait(timeout=60)
        for fd in self.go.values():
            os.close(fd)
        self.go.clear()
