"""What ends the processes the suite starts when the suite itself ends, however it ends.

A trainer process started fresh runs in a session of its own (so its whole job can be signalled
as one), and torchrun starts each rank in yet another: neither dies with the suite's process. So
each suite process that runs trainers starts a guardian first: a small process that holds the read
end of a pipe only the suite writes to, and a mark (GUARD_VAR) the suite puts in its own
environment, which every process it starts from then on inherits (a trainer, a rank, strace, a
fork server and its children; what a trainer starts too). When the pipe closes (a CI runner's
SIGTERM on cancel, a SIGKILL, a crash: the kernel closes it for any end), the guardian kills every
process that carries the mark and exits. Nothing is registered one by one, so a process the suite
started in the instant before it died is not missed. The guardian ignores the signals that end a
process group, so a SIGTERM to the suite's whole group cannot take it first.

    python -m conformance.run.guardian MARK
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading

from .proctree import sigkill

GUARD_VAR = "CONFORMANCE_GUARD"
_started = {"pid": 0}
_lock = threading.Lock()


def guard() -> None:
    """Start this process's guardian unless it runs: call before starting a trainer process."""
    with _lock:
        if _started["pid"] == os.getpid():
            return
        mark = f"{os.getpid()}-{secrets.token_hex(8)}"
        os.environ[GUARD_VAR] = mark   # inherited by all this process starts from now on
        proc = subprocess.Popen([sys.executable, "-m", "conformance.run.guardian", mark], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, start_new_session=True)
        proc._guardian_pipe = proc.stdin   # kept open for this process's life: its end is the signal
        _started.update(pid=os.getpid(), proc=proc)


def marked(mark: str) -> list[int]:
    """The processes whose environment carries `mark` (but this one)."""
    needle = b"\0" + f"{GUARD_VAR}={mark}".encode() + b"\0"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in b"\0" + f.read() + b"\0":
                    found.append(int(name))
        except OSError:
            continue
    return found


def main(mark: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)   # only the suite's end ends this
    while sys.stdin.buffer.read(1 << 16):
        pass
    for _ in range(3):   # a process that forked while the others were killed is caught the next time
        pids = marked(mark)
        if not pids:
            return
        for pid in pids:
            sigkill(pid)


if __name__ == "__main__":
    main(sys.argv[1])
