"""Warm trial runner: one process imports torch and the trainer's module once, then forks a fresh
child per trainer process.

A fresh interpreter spends seconds importing torch before it trains one step; a fork costs
milliseconds. The parent never runs a tensor op or touches CUDA, so children start with no thread
pools and no device state. Each child blocks on a pipe until released, so strace can attach to it
(`strace -p`) before it runs its first instruction of training: syscall-level crash points work
as on a fresh interpreter, and the suite's tests compare both runners on the same cases.

A multi-rank job is forked the same way: the child becomes a process group of its own and runs
torchrun's agent (rank.run_job), which forks the ranks from it, warm.

Protocol (JSON lines on the server's stdin/stdout; several children may run at once):
    -> {"op": "fork", "id": I, "module": M, "argv": [...], "env": {...}, "stderr": PATH[, "then": {...}]
        [, "job": [torchrun flags]]}
       ("then": run the module a second time in the same child, with that environment;
        "job": run it as a torchrun job with those flags)
    <- {"id": I, "pid": PID}
    -> {"op": "go", "id": I}        (or {"op": "abort", "id": I}: kill it unreleased)
    <- {"id": I, "status": RC}      (RC < 0: killed by signal -RC, as subprocess reports it)
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from ..model.adapters import TrainerAdapter
from .forked import SpareChild
from .warmup import huge_page_tunables, warm_up
from .zygote import drain, exited_children

# Where a root that forks fork servers listens (forkroot.py), for a harness that starts many suite
# processes: a Unix socket's path, or with a leading "@" a name in the abstract namespace.
ROOT_ENV = "CONFORMANCE_FORK_ROOT"


def socket_address(name: str) -> str:
    """A ROOT_ENV value as a socket address ("@name": the abstract namespace)."""
    return "\0" + name[1:] if name.startswith("@") else name


def server_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a fork server runs in: `env`, with bytecode writing off (children never
    write it: it would shift their write counts) and malloc on huge pages (warmup.py). A root of
    fork servers is started in it too, or its servers' environment differs and it is not used."""
    return dict(env, PYTHONDONTWRITEBYTECODE="1", GLIBC_TUNABLES=huge_page_tunables(env.get("GLIBC_TUNABLES")))


# What a server that forks jobs imports besides torch: torchrun's launcher and the collectives.
JOB_PRELOAD = ["torch.distributed.run", "torch.distributed.launcher.api",
               "torch.distributed.elastic.multiprocessing", "torch.distributed.checkpoint", "conformance.run.rank"]


@dataclasses.dataclass(frozen=True)
class WarmTarget:
    """What a forked child runs: a module (`python -m mod args`) or a script (`python train.py
    args`), with the interpreter the fork server is started with."""

    interpreter: str
    kind: str               # "module" or "script"
    target: str             # module name, or the script's absolute path
    argv: tuple[str, ...]


@functools.cache
def imports_same_torch(interpreter: str) -> bool:
    """Whether `interpreter` imports the torch this process would (same files): then its trainer
    processes can be forked from a warm server run by that interpreter."""
    if os.path.realpath(interpreter) == os.path.realpath(sys.executable):
        return True
    probe = "import importlib.util as u, os; print(os.path.realpath(u.find_spec('torch').origin))"
    try:
        theirs = subprocess.run([interpreter, "-c", probe], capture_output=True, text=True, timeout=120).stdout.strip()
        ours = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(theirs) and theirs == ours


def python_interpreter(argv) -> str | None:
    """The Python interpreter a trainer command starts with (its path), or None if it starts another
    program (a shell wrapper, a launcher)."""
    exe = shutil.which(argv[0]) if argv else None
    return exe if exe is not None and os.path.basename(exe).startswith("python") else None


def warm_target(adapter: TrainerAdapter) -> tuple[WarmTarget | None, str]:
    """The target a warm server can fork for this adapter, or None and why not."""
    argv = list(adapter.argv)
    exe = python_interpreter(argv)
    if exe is None:
        return None, "the command does not start a Python interpreter"
    if not imports_same_torch(exe):
        return None, f"{argv[0]} does not import the torch this suite runs with"
    if len(argv) >= 3 and argv[1] == "-m":
        return WarmTarget(exe, "module", argv[2], tuple(argv[3:])), ""
    if len(argv) >= 2 and not argv[1].startswith("-") and argv[1].endswith(".py") and os.path.isfile(argv[1]):
        return WarmTarget(exe, "script", os.path.abspath(argv[1]), tuple(argv[2:])), ""
    return None, "the command is neither `python -m module ...` nor `python script.py ...`"


# -- server side ----------------------------------------------------------------------------------
def serve(preload: list[str]) -> None:
    """Single-threaded (forking from a threaded process is unsafe): a select loop over requests on
    stdin and SIGCHLD (through a wakeup pipe); several children may run at once."""
    warm_up(preload)
    import selectors

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    stdin_fd = sys.stdin.fileno()
    sel.register(stdin_fd, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    running: dict[int, object] = {}     # pid -> request id
    waiting: dict[object, tuple[int, int]] = {}  # request id -> (pid, write end of its go pipe)

    def send(obj) -> None:
        os.write(1, (json.dumps(obj) + "\n").encode())

    def fork_spare() -> SpareChild:
        return SpareChild.fork((wake_r, wake_w, *(gw for _, gw in waiting.values())))

    # A child is forked ahead of its request, so the fork (a few ms: the page tables of torch's
    # imports) overlaps the client's work instead of delaying each trainer process.
    spare = fork_spare()

    def handle(req: dict) -> None:
        nonlocal spare
        rid = req.get("id")
        if req["op"] == "fork":
            child, spare = spare, None
            if not child.hand(req):   # it died unused (killed from outside): fork one now
                child = fork_spare()
                child.hand(req)
            running[child.pid] = rid
            waiting[rid] = (child.pid, child.go)
            send({"id": rid, "pid": child.pid})
            spare = fork_spare()
        elif req["op"] in ("go", "abort") and rid in waiting:
            pid, w = waiting.pop(rid)
            if req["op"] == "go":
                os.write(w, b"g")
            else:
                _kill(pid, group=req.get("group", False))
            os.close(w)

    def reap() -> None:
        for pid, rc in exited_children():
            if spare is not None and pid == spare.pid:   # died unused: replaced when next asked for
                spare.reaped = True
                continue
            send({"id": running.pop(pid, None), "status": rc})

    buf = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                drain(wake_r)
                continue
            data = os.read(stdin_fd, 1 << 16)
            if not data:   # the client went away: no new work; let running children finish
                if spare is not None:
                    spare.discard()
                for pid, _ in waiting.values():
                    _kill(pid)
                while running:
                    try:
                        os.waitpid(-1, 0)
                    except ChildProcessError:
                        break
                    running.popitem()
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    handle(json.loads(line))
        reap()


# -- client side ----------------------------------------------------------------------------------
class ForkServer:
    """Client of one server process; `run` may be called from several threads at once."""

    def __init__(self, preload: list[str], env: dict[str, str] | None = None, interpreter: str | None = None):
        env = server_env(env if env is not None else os.environ)
        root = os.environ.get(ROOT_ENV)
        self.proc = (root and _from_root(root, preload, env, interpreter or sys.executable)) or subprocess.Popen(
            [interpreter or sys.executable, "-m", "conformance.run.forkserver", *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._send_lock = threading.Lock()
        self._replies: dict[int, queue.Queue[dict]] = {}
        self._ids = itertools.count()
        self._dead = False
        self._reader = threading.Thread(target=self._read_replies, daemon=True)
        self._reader.start()

    def _read_replies(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            q = self._replies.get(msg.get("id"))
            if q is not None:
                q.put(msg)
        self._dead = True
        for q in list(self._replies.values()):
            q.put({"error": "fork server died"})

    def _send(self, obj) -> None:
        with self._send_lock:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()

    @staticmethod
    def _get(q: queue.Queue[dict], timeout: float | None = None) -> dict:
        """The next reply for one request; raises queue.Empty after `timeout` seconds."""
        msg = q.get(timeout=timeout)
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def run(self, module: str, argv: list[str], env: dict[str, str], stderr_path: Path,
            attach=None, watch=None, poll: float = 0.05, then_env: dict[str, str] | None = None,
            kind: str = "module", job: list[str] | None = None) -> tuple[int, str | None]:
        """Fork a child; `attach(pid)` runs before it is released (e.g. starts strace). While it
        runs, `watch()` is asked every `poll` seconds whether to stop it; returns (exit status,
        why it was stopped or None). With `job` (torchrun flags) the child is a job: its agent
        and ranks are stopped together."""
        rid = next(self._ids)
        q: queue.Queue[dict] = queue.Queue()
        self._replies[rid] = q
        try:
            if self._dead:   # registered after the reader's last word: no reply will ever come
                raise RuntimeError("fork server died")
            self._send({"op": "fork", "id": rid, "module": module, "argv": argv, "env": env,
                        "stderr": str(stderr_path), "kind": kind,
                        **({"then": then_env} if then_env is not None else {}),
                        **({"job": job} if job is not None else {})})
            pid = self._get(q)["pid"]
            tracer = None
            try:
                tracer = attach(pid) if attach else None
            except BaseException:
                self._send({"op": "abort", "id": rid, "group": job is not None})
                self._get(q)
                raise
            self._send({"op": "go", "id": rid})
            stopped = None
            while True:
                try:
                    status = self._get(q, poll)["status"]
                    break
                except queue.Empty:
                    stopped = stopped or (watch() if watch else None)
                    if stopped:
                        _kill(pid, group=job is not None)
            if job is not None:
                _kill(pid, group=True)   # no rank outlives its job
            if tracer is not None:
                try:
                    tracer.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    tracer.kill()
            return status, stopped
        finally:
            self._replies.pop(rid, None)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class _RootForked:
    """A fork server forked by a root (forkroot.py): what ForkServer uses of a Popen. It is not this
    process's child; its exit is seen through a pidfd."""

    def __init__(self, pid: int, stdin, stdout):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:   # already gone (its stdout says so at once)
            self._pidfd = None

    def wait(self, timeout: float | None = None) -> int:
        if self._pidfd is not None:
            if not select.select([self._pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout)
            os.close(self._pidfd)
            self._pidfd = None
        return 0

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


def _from_root(address: str, preload: list[str], env: dict[str, str], interpreter: str) -> _RootForked | None:
    """A fork server forked by the root at `address` for this process (see forkroot.py), or None
    (no root there, or it cannot stand in for a fresh `interpreter`)."""
    modules = {name: mod.__file__ for name in ("conformance", "torch", "numpy")
               if (mod := sys.modules.get(name)) is not None and getattr(mod, "__file__", None)}
    cwd = os.getcwd()
    # As a fresh interpreter reads PYTHONPATH: each entry made absolute, an empty one the directory.
    extra = [os.path.normpath(os.path.join(cwd, p)) for p in env["PYTHONPATH"].split(os.pathsep)] \
        if "PYTHONPATH" in env else []
    req = {"preload": preload, "env": env, "cwd": cwd, "extra_path": extra, "executable": interpreter,
           "modules": modules}
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(socket_address(address))
            socket.send_fds(sock, [json.dumps(req).encode() + b"\n"], [in_r, out_w, sys.stderr.fileno()])
            reply = json.loads(sock.makefile("rb").readline() or b"{}")
    except (OSError, ValueError):
        reply = {}
    finally:
        os.close(in_r)
        os.close(out_w)
    if "pid" not in reply:
        os.close(in_w)
        os.close(out_r)
        return None
    return _RootForked(reply["pid"], os.fdopen(in_w, "w"), os.fdopen(out_r, "r"))


def _kill(pid: int, group: bool = False) -> None:
    """SIGKILL `pid` (with `group`, its process group too: a job's agent and ranks)."""
    if group:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    serve(sys.argv[1:])
    # Every child has been reaped and nothing is buffered: skip the interpreter's teardown of torch
    # (about 0.8 s of CPU here), which every suite run would otherwise wait for once per server.
    sys.stderr.flush()
    os._exit(0)
