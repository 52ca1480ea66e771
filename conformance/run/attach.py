"""Attaching strace to a process that is already running (the warm runner's forked trainers and
ranks), and waiting until it is attached before the process goes on."""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from .proctree import exited


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


def announce_pid(directory: Path, rank: int, pid: int) -> None:
    """A traced warm rank tells the suite its pid: written whole (temp name, then rename), since
    `RankAttacher` reads the file as soon as the name exists."""
    tmp = directory / f".rank{rank}.tmp"
    tmp.write_text(str(pid))
    os.replace(tmp, directory / f"rank{rank}")


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
