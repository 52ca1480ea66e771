"""The suite's side of a warm fork server (forkserver.py): starting one, asking it for children,
and starting it again when it died.

A server is started fresh (`python -m conformance.run.forkserver`), or, where a harness that
starts many suite processes runs roots of fork servers (the project's own tests do: tests/forkroot.py),
forked by one of the roots named in CONFORMANCE_FORK_ROOT that can stand in for a fresh start.
"""
from __future__ import annotations

import itertools
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from .forkserver import server_env
from .proctree import kill_tree, sigkill

# Roots that fork fork servers, for a harness that starts many suite processes: a comma-separated
# list of Unix socket paths, or with a leading "@" names in the abstract namespace, each with the
# PYTHONHASHSEED it runs with (`@name=SEED`): a server with another hash secret is started fresh.
ROOT_ENV = "CONFORMANCE_FORK_ROOT"


class ServerDied(RuntimeError):
    """The fork server ended while a request was waiting for it."""


class ServerRefused(RuntimeError):
    """The fork server cannot fork safely (forkserver.fork_problem); the message says why."""


def socket_address(name: str) -> str:
    """A root's address as a socket address ("@name": the abstract namespace)."""
    return "\0" + name[1:] if name.startswith("@") else name


def roots(value: str | None = None) -> list[tuple[str, str | None]]:
    """(address, its PYTHONHASHSEED or None) of each root named in ROOT_ENV."""
    text = os.environ.get(ROOT_ENV, "") if value is None else value
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        address, _, seed = item.partition("=")
        out.append((address, seed or None))
    return out


class ForkServer:
    """Client of one server process; `run` may be called from several threads at once. A server
    that died is started again at the next request; a request it died before releasing is asked
    again once."""

    def __init__(self, preload: list[str], env: dict[str, str] | None = None, interpreter: str | None = None,
                 later: list[str] = ()):
        self.preload, self.later = list(preload), list(later)
        self.env = server_env(env if env is not None else os.environ)
        self.interpreter = interpreter or sys.executable
        self._send_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._ids = itertools.count()
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        argv = [*([f"--later={','.join(self.later)}"] if self.later else []), *self.preload]
        self.proc = _from_roots(argv, self.env, self.interpreter) or subprocess.Popen(
            [self.interpreter, "-m", "conformance.run.forkserver", *argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env)
        self._replies: dict[int, queue.Queue[dict]] = {}
        self._dead = False
        self._reader = threading.Thread(target=self._read_replies, args=(self.proc, self._replies), daemon=True)
        self._reader.start()

    def _read_replies(self, proc, replies: dict[int, queue.Queue[dict]]) -> None:
        for line in proc.stdout:
            msg = json.loads(line)
            q = replies.get(msg.get("id"))
            if q is not None:
                q.put(msg)
        if proc is self.proc:
            self._dead = True
        for q in list(replies.values()):
            q.put({"died": True})

    def _alive(self) -> None:
        """Start the server again if it died."""
        with self._start_lock:
            if self._dead:
                self.close()
                self.restarts += 1
                self._start()

    def _send(self, obj) -> None:
        with self._send_lock:
            try:
                self.proc.stdin.write(json.dumps(obj) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                raise ServerDied("the fork server died") from None

    @staticmethod
    def _get(q: queue.Queue[dict], timeout: float | None = None) -> dict:
        """The next reply for one request; raises queue.Empty after `timeout` seconds."""
        msg = q.get(timeout=timeout)
        if "died" in msg:
            raise ServerDied("the fork server died")
        if "refused" in msg:
            raise ServerRefused(msg["refused"])
        return msg

    def run(self, module: str, argv: list[str], env: dict[str, str], stderr_path: Path,
            attach=None, watch=None, poll: float = 0.05, then_env: dict[str, str] | None = None,
            kind: str = "module", job: list[str] | None = None, stop=None) -> tuple[int, str | None]:
        """Fork a child; `attach(pid)` runs before it is released (e.g. starts strace). While it
        runs, `watch()` is asked every `poll` seconds whether to stop it, and `stop(pid)` stops it
        (default: SIGKILL, a job's whole process tree); returns (exit status, why it was stopped or
        None). With `job` (torchrun flags) the child is a job: its agent and ranks end together."""
        request = {"op": "fork", "module": module, "argv": argv, "env": env, "stderr": str(stderr_path),
                   "kind": kind, "tracer": os.getpid(), **({"then": then_env} if then_env is not None else {}),
                   **({"job": job} if job is not None else {})}
        stop = stop or (lambda pid: kill_tree(pid) if job is not None else sigkill(pid))
        for attempt in (0, 1):
            self._alive()
            rid = next(self._ids)
            q: queue.Queue[dict] = queue.Queue()
            replies = self._replies
            replies[rid] = q
            try:
                if self._dead:   # registered after the reader's last word: no reply will ever come
                    raise ServerDied("the fork server died")
                self._send({**request, "id": rid})
                pid = self._get(q)["pid"]
            except ServerDied:
                replies.pop(rid, None)
                if attempt:
                    raise
                continue     # nothing ran yet: ask a new server once
            try:
                return self._released(q, rid, pid, attach, watch, poll, job, stop)
            finally:
                replies.pop(rid, None)
        raise AssertionError("unreachable")

    def _released(self, q, rid, pid, attach, watch, poll, job, stop) -> tuple[int, str | None]:
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
                    stop(pid)
        if job is not None:
            kill_tree(pid)   # no rank outlives its job
        if tracer is not None:
            try:
                tracer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                tracer.kill()
        return status, stopped

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class _RootForked:
    """A fork server forked by a root: what ForkServer uses of a Popen. It is not this process's
    child; its exit is seen through a pidfd."""

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


def _from_roots(argv: list[str], env: dict[str, str], interpreter: str) -> _RootForked | None:
    """A fork server forked for this process by a root named in ROOT_ENV that runs with this
    server's hash secret and can stand in for a fresh `interpreter`, or None."""
    for address, seed in roots():
        if seed is not None and env.get("PYTHONHASHSEED") != seed:
            continue
        forked = _from_root(address, argv, env, interpreter)
        if forked is not None:
            return forked
    return None


def _from_root(address: str, argv: list[str], env: dict[str, str], interpreter: str) -> _RootForked | None:
    """A fork server forked by the root at `address` (see tests/forkroot.py), or None (no root
    there, or it refused: it cannot stand in for a fresh `interpreter` with this environment)."""
    modules = {name: mod.__file__ for name in ("conformance", "torch", "numpy")
               if (mod := sys.modules.get(name)) is not None and getattr(mod, "__file__", None)}
    cwd = os.getcwd()
    # As a fresh interpreter reads PYTHONPATH: each entry made absolute, an empty one the directory.
    extra = [os.path.normpath(os.path.join(cwd, p)) for p in env["PYTHONPATH"].split(os.pathsep)] \
        if "PYTHONPATH" in env else []
    req = {"argv": argv, "env": env, "cwd": cwd, "extra_path": extra, "executable": interpreter, "modules": modules}
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
