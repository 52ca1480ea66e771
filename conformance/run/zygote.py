"""Warm ranks are forked from a process with one thread, never from torchrun's agent.

A fork copies every lock as it is at that instant, including locks other threads hold. The
agent runs the TCPStore server's thread, which calls getnameinfo (taking glibc's resolver lock)
as each rank connects; a rank forked in that instant waits for ever in its own first
getnameinfo, inside TCPStore's connect (seen in a soak: one rank in futex in
`_create_c10d_store`, its peer waiting for it; reproduced by forking while a client connects in
a loop: 2 hangs in 8 forks). torchrun execs its ranks and never meets this.

So the job process, while it still has one thread, forks a zygote (`RankZygote`). The agent's
entry point for each rank is `proxy_rank`: a small process that asks the zygote for the real
rank and stands in for it, forwarding the agent's signals and exiting as the rank did. A rank
whose proxy is gone is killed. The zygote dies with the job (PR_SET_PDEATHSIG); a rank does not,
as torchrun's do not: the signal torch has a dying agent send its workers (SIGINT) reaches the
proxy, which passes it on.
"""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import selectors
import signal
import socket
import time
from collections.abc import Callable

from .child import exit_like_interpreter

# The zygote's name in /proc/PID/comm: what tells it from a rank (nodes.ranks_left).
ZYGOTE_COMM = "rank-zygote"
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
# What the zygote sends a proxy once its rank's status is on the proxy's socket.
# Linux's own signals: looked up where they exist, so that the plugin imports on any system (and
# says there, as a usage error, that the suite runs on Linux only).
STATUS_READY = signal.SIGRTMIN + 1 if hasattr(signal, "SIGRTMIN") else None
FORWARDED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
                  if hasattr(signal, name))


def _prctl(option: int, arg) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent exits (and now, if it already has)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def exited_children():
    """(pid, status) of each child that has exited, without waiting; status < 0: killed by signal
    -status, as subprocess reports it. The fork server and a job's rank zygote reap with it."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


# How long a child just sent SIGKILL may take to be reaped: one in uninterruptible sleep (a hung
# network mount, a stuck driver) outlasts its SIGKILL until that wait ends, and nothing here waits
# for it for ever.
KILLED_EXIT_S = 30.0


def reap_killed(pids, timeout_s: float = KILLED_EXIT_S) -> list[int]:
    """Reap these children, each just sent SIGKILL, waiting at most `timeout_s` in all; returns
    those not reaped by then (still dying: nothing catches SIGKILL)."""
    left, deadline = set(pids), time.monotonic() + timeout_s
    while left:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:   # reaped already
                done = pid
            if done:
                left.discard(pid)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    return sorted(left)


def drain(fd: int) -> None:
    """Empty a non-blocking signal wakeup pipe (signal.set_wakeup_fd)."""
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _comm() -> bytes:
    with open("/proc/self/comm", "rb") as f:
        return f.read().strip()


class RankZygote:
    """The job's rank factory: forked by `start()` before the agent starts any thread; ranks are
    requested through `proxy_rank(address, ...)`, and `close()` ends it."""

    def __init__(self, pid: int, address: str):
        self.pid, self.address = pid, address

    @classmethod
    def start(cls, run_rank: Callable[[dict[str, str]], int]) -> RankZygote:
        """Fork the zygote; `run_rank(env)` is what each rank runs (its exit status)."""
        address = f"\0conformance-zygote-{os.getpid()}-{secrets.token_hex(4)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(64)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                die_with_parent(parent)
                _serve(listener, run_rank)
            finally:
                os._exit(1)
        listener.close()
        return cls(pid, address)

    def close(self) -> None:
        """Kill the zygote (its ranks die with it) and reap it."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap_killed([self.pid])


def _serve(listener: socket.socket, run_rank: Callable[[dict[str, str]], int]) -> None:
    """One thread: accept proxies, fork a rank per request, answer `pid P` then `status RC`
    (RC < 0: killed by signal -RC); a proxy that hangs up first has its rank killed."""
    own_comm = _comm()
    _prctl(_PR_SET_NAME, ZYGOTE_COMM.encode())
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for sig in FORWARDED:   # a signal to the whole job is for its ranks (they reset these), not for this
        signal.signal(sig, signal.SIG_IGN)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    requests: dict[socket.socket, bytes] = {}   # proxy -> its request so far
    rank_of: dict[socket.socket, int] = {}      # proxy -> its rank's pid
    proxy_of: dict[int, tuple[socket.socket, int]] = {}   # rank's pid -> its proxy (socket, pid)

    def hang_up(conn: socket.socket) -> None:
        sel.unregister(conn)
        conn.close()
        requests.pop(conn, None)
        pid = rank_of.pop(conn, None)
        if pid is not None:
            proxy_of.pop(pid, None)

    def fork_rank(conn: socket.socket, env: dict[str, str], proxy: int) -> None:
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, *FORWARDED):
                signal.signal(sig, signal.SIG_DFL)
            for fd in (listener.fileno(), sel.fileno(), wake_r, wake_w, conn.fileno(),
                       *(c.fileno() for c in (*requests, *rank_of))):
                os.close(fd)
            _prctl(_PR_SET_NAME, own_comm)
            code = 1
            try:
                code = run_rank(env)
            finally:
                exit_like_interpreter(code)
        rank_of[conn], proxy_of[pid] = pid, (conn, proxy)
        conn.sendall(f"pid {pid}\n".encode())

    while True:
        for key, _ in sel.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                requests[conn] = b""
                sel.register(conn, selectors.EVENT_READ)
            elif key.fileobj == wake_r:
                drain(wake_r)
            else:
                conn = key.fileobj
                data = conn.recv(1 << 16)
                if not data:
                    pid = rank_of.get(conn)
                    hang_up(conn)
                    if pid is not None:     # its proxy is gone: so is the rank
                        os.kill(pid, signal.SIGKILL)
                elif conn in requests:
                    requests[conn] += data
                    if b"\n" in requests[conn]:
                        request = json.loads(requests.pop(conn).split(b"\n", 1)[0])
                        fork_rank(conn, request["env"], request["proxy"])
        for pid, rc in exited_children():
            conn, proxy = proxy_of.pop(pid, (None, 0))
            if conn is not None:
                try:
                    conn.sendall(f"status {rc}\n".encode())
                    os.kill(proxy, STATUS_READY)
                except OSError:
                    pass
                hang_up(conn)


def proxy_rank(address: str) -> None:
    """torchrun's entry point for a warm rank, run in the process the agent forks: have the zygote
    at `address` fork the rank with this process's environment, pass the agent's signals on to it,
    and end as it ended (by the same signal, with the same status, or by returning for 0: the
    agent counts a rank done only once its return value arrived).

    Only signals from the agent are passed on: one sent to the whole job (a scheduler's SIGTERM to
    the process group) reaches the rank itself, and torchrun's rank gets it once, not twice. The
    proxy waits in one blocking call, so a stalled job shows no activity of its own."""
    agent = os.getppid()
    awaited = {*FORWARDED, STATUS_READY}
    signal.pthread_sigmask(signal.SIG_BLOCK, awaited)   # taken below with their sender
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    sock.sendall(json.dumps({"env": dict(os.environ), "proxy": os.getpid()}).encode() + b"\n")
    replies = sock.makefile("rb")
    pid = int(replies.readline().split()[1])
    while (info := signal.sigwaitinfo(awaited)).si_signo != STATUS_READY:
        if info.si_pid == agent:
            try:
                os.kill(pid, info.si_signo)
            except ProcessLookupError:
                pass
    rc = int(replies.readline().split()[1])
    # From here on this process is the finished worker torchrun's agent sees (its `_wrap` keeps a
    # successful one waiting until the others end): the agent's SIGTERM must end it, as it would
    # have ended a rank forked by the agent, not stay blocked until the agent's SIGKILL 30 s later.
    signal.signal(STATUS_READY, signal.SIG_IGN)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, awaited)
    if rc < 0:
        if -rc in FORWARDED:
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
        os._exit(128 - rc)
    if rc > 0:
        os._exit(rc)
