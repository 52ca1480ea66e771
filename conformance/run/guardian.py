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

Each trainer run carries a mark of its own under the suite's (`run_mark`: `<suite mark>/<run>`),
which the processes it starts inherit: what a trainer left running when its process ended (a
helper in a session of its own, reparented away from the run's process tree) is found by it
(`marked`), and the guardian's match on the suite's mark covers it too.

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
        # Under the mark this process was started with, if any (a suite a test of the project runs):
        # the guardian of the process that started it ends this one's processes too.
        inherited = os.environ.get(GUARD_VAR)
        mark = f"{inherited + '/' if inherited else ''}{os.getpid()}-{secrets.token_hex(8)}"
        os.environ[GUARD_VAR] = mark   # inherited by all this process starts from now on
        proc = subprocess.Popen([sys.executable, "-m", "conformance.run.guardian", mark], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, start_new_session=True)
        proc._guardian_pipe = proc.stdin   # kept open for this process's life: its end is the signal
        _started.update(pid=os.getpid(), proc=proc)


def run_mark() -> str:
    """A mark for one trainer run, under this process's (`guard` first): put in the run's
    environment (`marked_env`), it names the processes of that run and only those."""
    guard()
    return f"{os.environ[GUARD_VAR]}/{secrets.token_hex(6)}"


def marked_env(env: dict[str, str], mark: str) -> dict[str, str]:
    """`env` with the run mark `mark` in place of the suite's."""
    return {**env, GUARD_VAR: mark}


def marked(mark: str) -> list[int]:
    """The processes whose environment (as they were started: /proc/PID/environ) carries `mark`,
    or a run's mark under it (but this one)."""
    needle = f"\0{GUARD_VAR}={mark}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = b"\0" + f.read() + b"\0"
        except OSError:
            continue
        at = env.find(needle)
        while at >= 0:
            if env[at + len(needle):at + len(needle) + 1] in (b"\0", b"/"):
                found.append(int(name))
                break
            at = env.find(needle, at + 1)
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
