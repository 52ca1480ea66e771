"""The CPU load a soak runs under (`--load N`): N busy-loop processes beside the runs, and the load
average a soak prints at its start and end, so that "flaky under load" is tested under real load.

Its own module because the burners are a process fact, not a planning one: each burner must end
with the soak that started it, even when that soak is SIGKILLed and runs no cleanup (`BURNER`
watches its parent), and `Burners` stops them however the `with` block ends.
"""
from __future__ import annotations

import os
import subprocess
import sys

# A busy loop that also ends when its parent (soak, whose pid is its argument) is gone, even if soak
# was SIGKILLed, and even before the loop began (its own parent read at start-up would then be init).
BURNER = ("import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n"
          "    for _ in range(200000):\n        pass\n")


class Burners:
    """`n` busy-loop processes, for as long as the `with` block runs (they also end if soak dies)."""

    def __init__(self, n: int, *, argv: list[str] | None = None):
        self.n = n
        self.argv = argv or [sys.executable, "-S", "-c", BURNER, str(os.getpid())]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        try:
            for _ in range(self.n):
                self.procs.append(subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=60)   # SIGKILLed: gone within the minute, or TimeoutExpired names it


def load_text() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load average unavailable"
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min) on {os.cpu_count()} CPU(s)"
