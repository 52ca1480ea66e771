"""The suite's side of a warm fork server (forkserver.py): starting one, asking it for children,
and starting it again when it died.

A server is started fresh (`python -m conformance.run.forkserver`), or, where a harness that
starts many suite processes runs roots of fork servers (the project's own tests do: tests/forkroot.py),
forked by one of the roots named in CONFORMANCE_FORK_ROOT that can stand in for a fresh start.
Either way it gets a channel of its own, two pipes (forkserver.py): nothing a trainer's modules
print at import reaches it.

Every wait here has a deadline, and the error when it passes says what was waited for: the
server's warm-up (WARM_UP_S), each reply (REPLY_S), a root's answer (ROOT_S), a server's exit
(CLOSE_S). A server that ends, stops answering or writes anything but a reply ends every request
waiting on it, with why.
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
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .forkserver import Channel, server_env
from .proctree import kill_tree, sigkill

# Roots that fork fork servers, for a harness that starts many suite processes: a comma-separated
# list of Unix socket paths, or with a leading "@" names in the abstract namespace, each with the
# PYTHONHASHSEED it runs with (`@name=SEED`): a server with another hash secret is started fresh.
ROOT_ENV = "CONFORMANCE_FORK_ROOT"
# How long a server may take to import torch and the trainer's modules before it forks: a loaded
# machine takes tens of seconds for torch alone, and a trainer's imports (a library that builds an
# extension or reads a large file at import) may take minutes.
WARM_UP_S = 300.0
# A warm-up still running this long after the server started is asked, every as long again, what it
# waits on (its system calls over watchdog.WAIT_SAMPLE_S): one that waits on a lock file, which a
# process killed while holding it leaves for ever (torch's FileBaton, under which DeepSpeed builds its
# ops at import), is ended then, not after WARM_UP_S, and the trainer runs in fresh interpreters,
# whose watchdog names the file.
WARM_UP_PROBE_S = 20.0
# How long a warm server may take to answer a request: a fork and the hand-over of its request
# (twice forked.HAND_S at worst), an abort, or the exit of a child it was told to stop.
REPLY_S = 120.0
# How long a root may take to answer a connection: it forks the server at once.
ROOT_S = 60.0
# How long a server may take to exit once its request pipe closes, and a killed one to be gone.
CLOSE_S = 10.0
# A reply line longer than this is no reply (the channel carries something else).
MAX_LINE = 1 << 20


class ServerDied(RuntimeError):
    """The fork server ended, stopped answering or broke its protocol while a request waited for
    it; the message says which, and what the request waited for."""


class ServerRefused(RuntimeError):
    """The fork server cannot fork safely (forkserver.fork_problem); the message says why."""


class WarmUpFailed(ServerRefused):
    """The fork server ended, or did not finish, while it imported torch and the trainer's modules,
    before it forked any trainer process: it cannot stand in for a fresh interpreter of this
    trainer. Refused as a server that cannot fork safely is: the warm runner runs the trainer in
    fresh interpreters, which meet the same import, and their verdict is the trainer's."""


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
    that died after its warm-up is started again at the next request, and a request it died before
    releasing is asked again once; one that ended during its warm-up is not (WarmUpFailed)."""

    def __init__(self, preload: list[str], env: dict[str, str] | None = None, interpreter: str | None = None,
                 later: list[str] = ()):
        self.preload, self.later = list(preload), list(later)
        self.env = server_env(env if env is not None else os.environ)
        self.interpreter = interpreter or sys.executable
        # Held while the server is replaced: by close() (at most twice CLOSE_S) and a start (a
        # root's ROOT_S at most), so a request waits on it for a bounded time.
        self._start_lock = threading.Lock()
        self._ids = itertools.count()
        self.restarts = 0
        self._link = self._start()

    @property
    def proc(self):
        """The current server process (a Popen, or a root's child)."""
        return self._link.proc

    @property
    def ended(self) -> str | None:
        """Why the current server ended, or None while it runs."""
        return self._link.ended

    def _start(self) -> _Link:
        # --tracer: the suite's strace may attach to the server while it warms up (probe_warm_up)
        argv = [f"--tracer={os.getpid()}", *([f"--later={','.join(self.later)}"] if self.later else []), *self.preload]
        for address, seed in roots():
            if seed is not None and self.env.get("PYTHONHASHSEED") != seed:
                continue
            link = _Link.open(lambda channel, address=address: _from_root(address, argv, channel, self.env,
                                                                          self.interpreter))
            if link is not None:
                return link
        return _Link.open(lambda channel: subprocess.Popen(
            [self.interpreter, "-m", "conformance.run.forkserver", channel.option(), *argv],
            stdin=subprocess.DEVNULL, pass_fds=channel.fds(), env=self.env))

    def _current(self) -> _Link:
        """The running server: started again if it ended after its warm-up."""
        with self._start_lock:
            link = self._link
            if link.ended is not None:
                if link.in_warm_up:
                    raise WarmUpFailed(link.ended)
                link.close()
                self.restarts += 1
                self._link = link = self._start()
            return link

    def run(self, module: str, argv: list[str], env: dict[str, str], stderr_path: Path,
            attach=None, watch=None, poll: float = 0.05, then_env: dict[str, str] | None = None,
            kind: str = "module", job: list[str] | None = None, stop=None) -> tuple[int, str | None]:
        """Fork a child; `attach(pid)` runs before it is released (e.g. starts strace). While it
        runs, `watch()` is asked every `poll` seconds whether to stop it, and `stop(pid)` stops it
        (default: SIGKILL, a job's whole process tree); returns (exit status, why it was stopped or
        None). With `job` (torchrun flags) the child is a job: its agent and ranks end together.
        Without `watch` nothing bounds how long the child runs."""
        request = {"op": "fork", "module": module, "argv": argv, "env": env, "stderr": str(stderr_path),
                   "kind": kind, "tracer": os.getpid(), **({"then": then_env} if then_env is not None else {}),
                   **({"job": job} if job is not None else {})}
        stop = stop or (lambda pid: kill_tree(pid) if job is not None else sigkill(pid))
        for attempt in (0, 1):
            link = self._current()
            rid = next(self._ids)
            try:
                q = link.register(rid, f"the fork of a {module} process")
                try:
                    sent = time.monotonic()
                    link.send({**request, "id": rid}, f"the request to fork a {module} process")
                    pid = link.reply(q, f"the pid of a {module} process it was asked to fork", sent)["pid"]
                except BaseException:
                    link.unregister(rid)
                    raise
            except ServerDied:
                if attempt:
                    raise
                continue     # nothing ran yet: ask a new server once
            try:
                return self._released(link, q, rid, pid, f"{module} process {pid}", attach, watch, poll, job, stop)
            finally:
                link.unregister(rid)
        raise AssertionError("unreachable")

    @staticmethod
    def _released(link: _Link, q: queue.Queue[dict], rid: int, pid: int, child: str, attach, watch, poll: float,
                   job, stop) -> tuple[int, str | None]:
        tracer = None
        try:
            tracer = attach(pid) if attach else None
        except BaseException:
            try:
                sent = time.monotonic()
                link.send({"op": "abort", "id": rid, "group": job is not None}, f"the abort of {child}")
                link.reply(q, f"the exit of {child}, aborted before its release", sent)
            except ServerDied:   # the child dies with its server
                pass
            raise
        try:
            link.send({"op": "go", "id": rid}, f"the release of {child}")
            stopped, stopped_at = None, None
            while True:
                msg = link.next(q, poll, f"the exit status of {child}")
                if msg is not None:
                    return msg["status"], stopped
                stopped = stopped or (watch() if watch else None)
                if stopped:
                    stop(pid)
                    stopped_at = stopped_at or time.monotonic()
                    if time.monotonic() - stopped_at > REPLY_S:   # link.next raises from here on
                        link.end(f"the fork server was ended: it reported no exit {REPLY_S:.0f} s after the suite "
                                 f"stopped {child}", kill=True)
        finally:
            if job is not None:
                kill_tree(pid)   # no rank outlives its job
            if tracer is not None:   # attach.Tracer or RankAttacher: bounded, and ends what strace still follows
                tracer.release()

    def close(self) -> None:
        self._link.close()


class _Link:
    """One server process and the suite's ends of its channel. A reader thread follows the warm-up
    and hands each reply to the queue of the request it answers; when the server ends, stops
    answering or writes anything but a reply, `ended` says so and every waiting request is woken."""

    def __init__(self, proc, requests: int, replies: int):
        self.proc, self.requests = proc, requests
        os.set_blocking(requests, False)
        self.started = time.monotonic()
        self.warming: str | None = None     # the warm-up's step now, as the server said ("importing M")
        self.ready_at: float | None = None
        self.ended: str | None = None
        self.in_warm_up = False             # whether it ended before it was ready
        self.probed_at = self.started       # when the warm-up was last asked what it waits on
        self._probe_lock = threading.Lock()  # one probe at a time, whichever request's wait runs it
        self.closed = False
        self._queues: dict[int, queue.Queue[dict]] = {}
        self._lock = threading.Lock()       # the queues and `ended`: held for no wait
        self._send_lock = threading.Lock()  # one request written at a time
        self.reader = threading.Thread(target=self._read, args=(replies,), daemon=True,
                                       name=f"fork server {proc.pid}: replies")
        self.reader.start()

    @classmethod
    def open(cls, start: Callable[[Channel], object]) -> _Link | None:
        """A link to the server `start(channel)` starts on a new pair of pipes (None: it started none)."""
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        proc = None
        try:
            proc = start(Channel(req_r, rep_w))
        finally:
            os.close(req_r)
            os.close(rep_w)
            if proc is None:
                os.close(req_w)
                os.close(rep_r)
        return cls(proc, req_w, rep_r) if proc is not None else None

    # -- the reader thread --------------------------------------------------------------------
    def _read(self, fd: int) -> None:
        buf = b""
        try:
            while not self.closed:
                if not select.select([fd], [], [], 1.0)[0]:
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip() and not self._deliver(line):
                        return
                if len(buf) > MAX_LINE:
                    self._deliver(buf)
                    return
            if not self.closed:
                self.end(self._exit_text())
        finally:
            os.close(fd)

    def _deliver(self, line: bytes) -> bool:
        """Hand one line to its waiter; False (and the server ended) if it is no reply."""
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError(line)
        except ValueError:
            quoted = repr(line[:80].decode(errors="replace")) + (" ..." if len(line) > 80 else "")
            self.end(f"the fork server was ended: its reply channel carried a line that is no reply, {quoted}",
                     kill=True)
            return False
        rid = msg.get("id")
        if "warm_up" in msg:
            self.warming = str(msg["warm_up"])
        elif msg.get("ready"):
            self.ready_at = time.monotonic()
        elif isinstance(rid, int):
            with self._lock:
                q = self._queues.get(rid)
            if q is not None:
                q.put(msg)
        return True

    # -- ending ---------------------------------------------------------------------------------
    def _doing(self) -> str:
        if self.ready_at is not None:
            return ""
        return f", {f'while {self.warming}' if self.warming else 'as it started'}, before it forked any trainer process"

    def end(self, why: str, kill: bool = False) -> None:
        """The server is gone or useless: say why (the first reason counts), kill it if asked, and
        wake every waiting request."""
        with self._lock:
            if self.ended is None:
                self.in_warm_up = self.ready_at is None
                self.ended = why + self._doing()
            waiters = list(self._queues.values())
        if kill:
            self.kill()
        for q in waiters:
            q.put({"died": self.ended})

    def _exit_text(self) -> str:
        """How the server ended, as far as this process can tell (a root's child: not its status)."""
        try:
            self.proc.wait(timeout=CLOSE_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return "the fork server was ended: it closed its reply channel"
        code = self.proc.returncode
        if code is None:
            return "the fork server ended"
        if code < 0:
            try:
                return f"the fork server was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"the fork server was killed by signal {-code}"
        return f"the fork server exited with status {code}"

    def failure(self, waited_for: str) -> ServerDied | WarmUpFailed:
        """The error for a request that waited for `waited_for` on this ended server."""
        if self.in_warm_up:
            return WarmUpFailed(self.ended)
        return ServerDied(f"{self.ended}; the suite was waiting for {waited_for}")

    def check(self) -> None:
        """End the link if the server exited while its reply channel stays open (a process its
        trainer's import forked holds the write end)."""
        if self.ended is None and self.proc.poll() is not None:
            self.reader.join(timeout=1.0)   # its last replies, if the channel closed too
            self.end(self._exit_text())

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass

    # -- requests -------------------------------------------------------------------------------
    def register(self, rid: int, waited_for: str) -> queue.Queue[dict]:
        q: queue.Queue[dict] = queue.Queue()
        with self._lock:
            if self.ended is not None:   # after the reader's last word: no reply will ever come
                raise self.failure(waited_for)
            self._queues[rid] = q
        return q

    def unregister(self, rid: int) -> None:
        with self._lock:
            self._queues.pop(rid, None)

    def send(self, obj: dict, what: str) -> None:
        """Write one request; raises (failure) if the server ended, or read none of the channel for
        REPLY_S."""
        data = memoryview((json.dumps(obj) + "\n").encode())
        sent_at = time.monotonic()
        # A server reads no request before its warm-up ends: until then the warm-up's deadline holds.
        if not self._send_lock.acquire(timeout=WARM_UP_S + REPLY_S):
            raise ServerDied(f"the channel to the fork server was busy for {WARM_UP_S + REPLY_S:.0f} s, so {what} "
                             "could not be sent")
        try:
            while data:
                if self.ended is not None:
                    raise self.failure(f"the server to take {what}")
                try:
                    data = data[os.write(self.requests, data):]
                except BlockingIOError:
                    warming = self.ready_at is None
                    deadline = self.started + WARM_UP_S if warming else max(sent_at, self.ready_at) + REPLY_S
                    left = deadline - time.monotonic()
                    if left <= 0 and warming:
                        self.end(f"the fork server was ended: it had not finished its warm-up {WARM_UP_S:.0f} s after "
                                 "it started", kill=True)
                    elif left <= 0:
                        self.end(f"the fork server was ended: it read no request for {REPLY_S:.0f} s", kill=True)
                    else:
                        select.select([], [self.requests], [], min(left, 1.0))
                except OSError:   # the server closed its end (it exited), or the link was closed
                    self.end(self._exit_text())
        finally:
            self._send_lock.release()

    def next(self, q: queue.Queue[dict], timeout: float, waited_for: str) -> dict | None:
        """The next reply on `q` within `timeout`, or None; raises (failure) once the server ended,
        ServerRefused when it refuses."""
        try:
            msg = q.get(timeout=timeout)
        except queue.Empty:
            self.check()
            return None
        if "died" in msg:
            raise self.failure(waited_for)
        if "refused" in msg:
            raise ServerRefused(msg["refused"])
        return msg

    def reply(self, q: queue.Queue[dict], waited_for: str, sent_at: float) -> dict:
        """The reply to a request sent at `sent_at`: due WARM_UP_S after the server started while
        it warms up, then REPLY_S after the later of the request and the end of its warm-up."""
        while True:
            msg = self.next(q, 1.0, waited_for)
            if msg is not None:
                return msg
            now = time.monotonic()
            if self.ready_at is None and now - self.started > WARM_UP_S:
                self.end(f"the fork server was ended: it had not finished its warm-up {WARM_UP_S:.0f} s after it "
                         "started", kill=True)
            elif self.ready_at is None and now - self.probed_at > WARM_UP_PROBE_S:
                self.probe_warm_up()
            elif self.ready_at is not None and now - max(sent_at, self.ready_at) > REPLY_S:
                self.end(f"the fork server was ended: it sent no reply for {REPLY_S:.0f} s", kill=True)

    def probe_warm_up(self) -> None:
        """End the server if its warm-up waits on a lock file (WARM_UP_PROBE_S); a warm-up that is
        only slow (a large import, a sleep, a build that makes progress) goes on."""
        if not self._probe_lock.acquire(blocking=False):
            return
        try:
            from .watchdog import waiting_on  # deferred: only a warm-up that runs long asks
            with tempfile.TemporaryDirectory(prefix="conformance-warm-up-") as scratch:
                found = waiting_on([self.proc.pid], Path(scratch)).get(self.proc.pid)
            self.probed_at = time.monotonic()
            if found is not None and found.path is not None and self.ready_at is None:
                self.end(f"the fork server was ended during its warm-up ({self.warming or 'importing the trainer'}, "
                         f"{time.monotonic() - self.started:.0f} s after it started): it waits on {found.path} "
                         f"({found.how})", kill=True)
        finally:
            self._probe_lock.release()

    def close(self) -> None:
        """Close the request pipe (the server kills its children and exits), wait for the server
        to exit (CLOSE_S; then it is killed), and stop the reader."""
        if self._send_lock.acquire(timeout=REPLY_S):   # a write in progress is itself bounded by REPLY_S
            try:
                if self.requests >= 0:
                    os.close(self.requests)
                    self.requests = -1
            finally:
                self._send_lock.release()
        try:
            self.proc.wait(timeout=CLOSE_S)
        except subprocess.TimeoutExpired:
            self.kill()
            try:
                self.proc.wait(timeout=CLOSE_S)
            except subprocess.TimeoutExpired:
                pass
        self.closed = True
        self.end("the fork server was closed")


class _RootForked:
    """A fork server forked by a root: what _Link uses of a Popen. It is not this process's child:
    its exit is seen through a pidfd, and its status is the root's to read (returncode stays None)."""

    returncode = None

    def __init__(self, pid: int):
        self.pid = pid
        self._lock = threading.Lock()   # the pidfd; held at most for a wait's timeout
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:   # already gone (its reply channel says so at once)
            self._pidfd = None

    def wait(self, timeout: float) -> int:
        with self._lock:
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
        if not self._lock.acquire(timeout=CLOSE_S):   # a wait holds it at most CLOSE_S
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        finally:
            self._lock.release()


def _from_root(address: str, argv: list[str], channel: Channel, env: dict[str, str],
               interpreter: str) -> _RootForked | None:
    """A fork server forked by the root at `address` (see tests/forkroot.py) on `channel`, or None
    (no root there, it refused: it cannot stand in for a fresh `interpreter` with this environment,
    or it did not answer within ROOT_S)."""
    modules = {name: mod.__file__ for name in ("conformance", "torch", "numpy")
               if (mod := sys.modules.get(name)) is not None and getattr(mod, "__file__", None)}
    cwd = os.getcwd()
    # As a fresh interpreter reads PYTHONPATH: each entry made absolute, an empty one the directory.
    extra = [os.path.normpath(os.path.join(cwd, p)) for p in env["PYTHONPATH"].split(os.pathsep)] \
        if "PYTHONPATH" in env else []
    req = {"argv": argv, "env": env, "cwd": cwd, "extra_path": extra, "executable": interpreter, "modules": modules}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(ROOT_S)
            sock.connect(socket_address(address))
            socket.send_fds(sock, [json.dumps(req).encode() + b"\n"], [*channel.fds(), 2])
            reply = json.loads(sock.makefile("rb").readline() or b"{}")
    except (OSError, ValueError):   # socket.timeout included
        reply = {}
    return _RootForked(reply["pid"]) if "pid" in reply else None
