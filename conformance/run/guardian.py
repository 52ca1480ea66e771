"""What ends the fresh interpreters the suite starts when the suite itself ends, however it ends.

A trainer process started fresh runs in a session of its own (so its whole job can be signalled
as one), and torchrun starts each rank in yet another: neither dies with the suite's process. A
guardian, one small process per suite process, holds the read end of a pipe only the suite
writes to. The suite registers each process tree it starts and releases it when the run is over;
when the pipe closes (a CI runner's SIGTERM on cancel, a SIGKILL, a crash: the kernel closes it
for any end), the guardian kills every tree still registered and exits. It ignores the signals
that end a process group, so a SIGTERM to the suite's whole group cannot take it first. The
warm runner needs none of this: a fork server kills its children when its own pipe closes
(forkserver.serve).

    python -m conformance.run.guardian     (protocol on stdin: "+PID START" registers, "-PID" releases)
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading

from .proctree import kill_tree, start_time


class Guardian:
    """The suite's side: one guardian per process, started on first use."""

    _lock = threading.Lock()
    _proc: subprocess.Popen | None = None
    _owner = 0

    @classmethod
    def _pipe(cls):
        if cls._proc is None or cls._owner != os.getpid() or cls._proc.poll() is not None:
            cls._proc = subprocess.Popen([sys.executable, "-m", "conformance.run.guardian"], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, text=True, start_new_session=True)
            cls._owner = os.getpid()
            atexit.register(cls._proc.stdin.close)
        return cls._proc.stdin

    @classmethod
    def _say(cls, line: str) -> None:
        with cls._lock:
            try:
                pipe = cls._pipe()
                pipe.write(line + "\n")
                pipe.flush()
            except OSError:
                pass   # no guardian: the run goes on, as it would have without one

    @classmethod
    def watch(cls, pid: int) -> None:
        """Kill the process tree under `pid` if this process ends before `release(pid)`."""
        cls._say(f"+{pid} {start_time(pid)}")

    @classmethod
    def release(cls, pid: int) -> None:
        cls._say(f"-{pid}")


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)   # only the suite's end ends this
    watched: dict[int, str] = {}
    for line in sys.stdin:
        sign, _, rest = line.strip().partition(" ")
        if sign.startswith("+"):
            watched[int(sign[1:])] = rest
        elif sign.startswith("-"):
            watched.pop(int(sign[1:]), None)
    for pid, started in watched.items():
        if start_time(pid) == started:   # the same process, not one that reused its pid
            kill_tree(pid)


if __name__ == "__main__":
    main()
