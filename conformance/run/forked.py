"""A fork server's child: forked before its request (SpareChild), released once strace is attached
(run_released), then the trainer run as `python -m` or `python script.py` would run it."""
from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import time

from .attach import allow_tracer
from .child import exit_like_interpreter, forget_parents_finalizers, run_target
from .zygote import die_with_parent, reap_killed


def run_released(module: str, argv: list[str], env: dict[str, str], stderr_path: str, go_fd: int,
                 then_env: dict[str, str] | None = None, kind: str = "module", job: list[str] | None = None) -> None:
    """Wait on `go_fd` until released (strace may attach meanwhile), then run the trainer as a
    fresh interpreter would (stdin and stdout on /dev/null, stderr to its file), and exit."""
    if job is not None:
        os.setsid()   # the job (agent and ranks) is one process group: stopped with one signal
    os.read(go_fd, 1)
    os.close(go_fd)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C raises KeyboardInterrupt (runners.terminal_signals)
    import warnings
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                            category=RuntimeWarning)
    if job is not None:
        os.environ.clear()
        os.environ.update(env)
        from .rank import run_job  # deferred: only a job's child imports torchrun's launcher
        code = run_job(job, module, argv, kind)
    else:
        code = run_target(module, argv, env, kind)
    if code == 0 and then_env is not None:   # a second run in the same process (diagnosis)
        code = run_target(module, argv, then_env, kind)
    exit_like_interpreter(code)


# How long a spare child may take to read its request: it is already running, so only a child
# stopped or killed from outside, or a machine too loaded to run it at all, takes longer.
HAND_S = 20.0


@dataclasses.dataclass
class SpareChild:
    """A child forked before its request: it reads the request from its go pipe (length, then
    JSON), closes its end of the acknowledgement pipe, and then waits for "g" like any child, so
    strace attaches to a child in the same state either way. It closes every descriptor of its
    server's (`inherited`: the protocol channel, the wakeup pipe, other children's go pipes) first."""

    pid: int
    go: int          # write end of the child's pipe: its request, then "g"
    ack: int         # read end: EOF once the child has its request
    reaped: bool = False

    @classmethod
    def fork(cls, inherited: tuple[int, ...]) -> SpareChild:
        r, w = os.pipe()
        ack_r, ack_w = os.pipe()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            die_with_parent(server)   # a trainer process never outlives its server
            forget_parents_finalizers()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (w, ack_r, *inherited):
                os.close(fd)
            req = _read_request(r)
            if req is None:   # the server went away before handing it out
                os._exit(0)
            allow_tracer(req.get("tracer"))   # before strace attaches: it does once the ack is seen
            os.close(ack_w)
            run_released(req["module"], req["argv"], req["env"], req["stderr"], r, req.get("then"),
                         req.get("kind", "module"), req.get("job"))
        os.close(r)
        os.close(ack_w)
        return cls(pid, w, ack_r)

    def hand(self, req: dict) -> bool:
        """Give the child its request and wait until it has read it (at most HAND_S); False if it
        is gone or did not take it in time (then it is killed)."""
        body = json.dumps(req).encode()
        deadline = time.monotonic() + HAND_S
        try:
            if self.reaped:
                raise BrokenPipeError
            data = memoryview(len(body).to_bytes(8, "big") + body)
            os.set_blocking(self.go, False)
            while data:
                try:
                    data = data[os.write(self.go, data):]
                except BlockingIOError:   # a request larger than the pipe: the child reads it as it goes
                    if not select.select([], [self.go], [], max(0.0, deadline - time.monotonic()))[1]:
                        raise BrokenPipeError from None
            os.set_blocking(self.go, True)
            if not select.select([self.ack], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise BrokenPipeError
            os.read(self.ack, 1)
            return True
        except BrokenPipeError:
            self.discard()
            return False
        finally:
            if self.ack >= 0:
                os.close(self.ack)
                self.ack = -1

    def discard(self) -> None:
        """Close its pipes, kill and reap it (a spare never handed out, or found dead)."""
        for fd in (self.go, self.ack):
            if fd >= 0:
                os.close(fd)
        self.go = self.ack = -1
        if not self.reaped:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            reap_killed([self.pid])
            self.reaped = True


def _read_request(fd: int) -> dict | None:
    """A spare child's request from its pipe (None at EOF)."""
    def exactly(n: int) -> bytes | None:
        parts = []
        while n:
            part = os.read(fd, n)
            if not part:
                return None
            parts.append(part)
            n -= len(part)
        return b"".join(parts)
    head = exactly(8)
    body = exactly(int.from_bytes(head, "big")) if head is not None else None
    return json.loads(body) if body is not None else None
