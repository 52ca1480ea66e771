"""Warm trial runner, the server: one process imports torch and the trainer's module once, then
forks a fresh child per trainer process (forkclient.py is the suite's side).

A fresh interpreter spends seconds importing torch before it trains one step; a fork costs
milliseconds. The server never runs a tensor op or touches CUDA, so children start with no thread
pools and no device state, and it loads what the trainer imports only later out of sight
(deferred.py). Each child blocks on a pipe until released, so strace can attach to it (`strace
-p`) before it runs its first instruction of training: syscall-level crash points work as on a
fresh interpreter, and the suite's tests compare both runners on the same cases.

A multi-rank job is forked the same way: the child becomes a process group of its own and runs
torchrun's agent (rank.run_job), which forks the ranks from it, warm.

The protocol runs on a channel of the server's own: two pipes it is handed (`--channel=R,W`),
never its standard streams. Before it imports anything of the trainer's it makes them private
(close-on-exec, and closed in every child it forks), points its stdin at /dev/null and its stdout
at its stderr (its log): what a trainer's module or its libraries print or write to fd 1 at import
goes to that log, a read of stdin ends at once, and a closed fd 1 closes nothing of the channel.
Each child, which runs the module again, has stdin and stdout on /dev/null, as the fresh runner
gives a trainer process.

Protocol (JSON lines: requests read from R, replies written to W; several children may run at once):
    <- {"warm_up": STEP}            (before each step of its warm-up: "importing torch", "importing M", ...)
    <- {"ready": true}              (warm-up done: requests sent meanwhile are answered from here on)
    -> {"op": "fork", "id": I, "module": M, "argv": [...], "env": {...}, "stderr": PATH, "tracer": PID
        [, "then": {...}][, "job": [torchrun flags]]}
       ("tracer": the process whose descendants may ptrace the child (Yama's PR_SET_PTRACER);
        "then": run the module a second time in the same child, with that environment;
        "job": run it as a torchrun job with those flags)
    <- {"id": I, "pid": PID}        (or {"id": I, "refused": WHY}: the server cannot fork safely, or
                                     the child it forked did not take the request within forked.HAND_S)
    -> {"op": "go", "id": I}        (or {"op": "abort", "id": I}: kill it unreleased)
    <- {"id": I, "status": RC}      (RC < 0: killed by signal -RC, as subprocess reports it)
A module that exits or raises as the server imports it does not end the server: each child then
imports it again, as a fresh interpreter does, and ends as that interpreter would.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping

from ..model.adapters import TrainerAdapter
from ..model.importing import python_target
from .attach import allow_tracer
from .forked import HAND_S, SpareChild
from .proctree import kill_tree, sigkill
from .warmup import LIBRARY_THREADS, UNEXPLAINED_THREADS, huge_page_tunables, thread_count, warm_up
from .zygote import drain, exited_children, reap_killed


def server_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a fork server runs in: `env`, with bytecode writing off (children never
    write it: it would shift their write counts) and malloc on huge pages (warmup.py). A root of
    fork servers is started in it too, or its servers' environment differs and it is not used."""
    return dict(env, PYTHONDONTWRITEBYTECODE="1", GLIBC_TUNABLES=huge_page_tunables(env.get("GLIBC_TUNABLES")))


# What a server that forks jobs loads besides torch, out of sight until used (the job's agent uses
# them; a rank only what its trainer imports): torchrun's launcher and the collectives.
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
    target = python_target(argv)
    if target is not None and target[0] == "module":
        return WarmTarget(exe, "module", target[1], target[2]), ""
    if target is not None and os.path.isfile(target[1]):
        return WarmTarget(exe, "script", os.path.abspath(target[1]), target[2]), ""
    return None, "the command is neither `python -m module ...` nor `python script.py ...`"


# -- server side ----------------------------------------------------------------------------------
class NotForkable(RuntimeError):
    """The server cannot fork safely: a thread other than its own runs in it."""


def fork_problem() -> str | None:
    """Why this process must not fork now, or None: a fork copies every lock as it is at that
    instant, including those another thread holds, so the server forks only with the threads of
    fork-aware pools (warmup.LIBRARY_THREADS: importing torch, and BLAS or OpenMP runtimes the
    trainer's imports loaded) and no Python thread but its own."""
    threads, allowed = thread_count(), sum(LIBRARY_THREADS) or 1
    python = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads <= allowed and not python:
        return None
    started = f" ({', '.join(sorted(python))} in Python)" if python else ""
    who = "".join(f"; importing {m} started {n} that no thread-pool runtime accounts for"
                  for m, n in UNEXPLAINED_THREADS)
    return (f"the fork server runs {threads} threads{started}, {threads - allowed} more than its fork-aware "
            f"library pools{who}, so forking it is unsafe")


@dataclasses.dataclass(frozen=True)
class Channel:
    """The server's protocol channel: the descriptors it reads requests from and writes replies to."""

    requests: int
    replies: int

    OPTION = "--channel="

    @classmethod
    def parse(cls, value: str) -> Channel:
        """`R,W` (the value of --channel)."""
        try:
            requests, replies = (int(fd) for fd in value.split(","))
        except ValueError:
            raise SystemExit(f"forkserver: {cls.OPTION}{value}: expected two descriptors, R,W") from None
        return cls(requests, replies)

    def option(self) -> str:
        return f"{self.OPTION}{self.requests},{self.replies}"

    def fds(self) -> tuple[int, int]:
        return self.requests, self.replies


def take_channel(channel: Channel) -> Channel:
    """Make the channel this process's own before anything of the trainer's runs in it: both
    descriptors close-on-exec (a helper a trainer's import execs does not hold them) and above the
    standard streams, stdin on /dev/null (a read at import ends at once, and takes no request) and
    stdout on stderr (what is printed at import goes to the server's log)."""
    import fcntl
    moved = Channel(*(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in channel.fds()))
    for fd in channel.fds():
        if fd > 2:
            os.close(fd)
    point_standard_streams()
    return moved


def point_standard_streams() -> None:
    """stdin on /dev/null, stdout where stderr goes; again after the warm-up, which may have closed
    or moved them (a descriptor the server opens later must not land on fd 0 or 1)."""
    def onto(fd: int, target: int) -> None:
        if fd != target:   # a free fd 0 or 1 is what open() itself returns
            os.dup2(fd, target)
            os.close(fd)

    onto(os.open(os.devnull, os.O_RDONLY), 0)
    try:
        os.dup2(2, 1)
    except OSError:   # no stderr either (closed at import): stdout goes nowhere
        onto(os.open(os.devnull, os.O_WRONLY), 1)


def serve(channel: Channel, preload: list[str], later: list[str] = ()) -> None:
    """Single-threaded (forking from a threaded process is unsafe): a select loop over requests on
    the channel and SIGCHLD (through a wakeup pipe); several children may run at once. When the
    request pipe closes (the client is gone, however it ended), every child still running is killed
    (a job: its whole process group) and reaped before the server exits: nothing it started
    outlives it."""
    channel = take_channel(channel)

    def send(obj) -> None:
        data = memoryview((json.dumps(obj) + "\n").encode())
        try:
            while data:
                data = data[os.write(channel.replies, data):]
        except BrokenPipeError:   # the client is gone: the request pipe's EOF ends this server
            pass

    warm_up(preload, later, announce=lambda step: send({"warm_up": step}))
    point_standard_streams()
    for stream in (sys.stdout, sys.stderr):   # the import's output, before children inherit it unwritten
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    send({"ready": True})
    import selectors

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(channel.requests, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    running: dict[int, tuple[object, bool]] = {}   # pid -> (request id, whether it is a job's group)
    waiting: dict[object, tuple[int, int]] = {}    # request id -> (pid, write end of its go pipe)

    def fork_spare() -> SpareChild | None:
        if fork_problem() is not None:
            return None
        return SpareChild.fork((*channel.fds(), wake_r, wake_w, *(gw for _, gw in waiting.values())))

    # A child is forked ahead of its request, so the fork (the page tables of torch's imports)
    # overlaps the client's work instead of delaying each trainer process.
    spare = fork_spare()

    def handle(req: dict) -> None:
        nonlocal spare
        rid = req.get("id")
        if req["op"] == "fork":
            problem = fork_problem()
            if problem is not None:
                send({"id": rid, "refused": problem})
                return
            child, spare = spare, None
            if child is None or not child.hand(req):   # it died unused (killed from outside): fork one now
                child = fork_spare()
                if child is None or not child.hand(req):
                    send({"id": rid, "refused": fork_problem() or f"the child it forked for the request did not take "
                                                                  f"it within {HAND_S:.0f} s"})
                    spare = fork_spare()
                    return
            running[child.pid] = (rid, req.get("job") is not None)
            waiting[rid] = (child.pid, child.go)
            send({"id": rid, "pid": child.pid})
            spare = fork_spare()
        elif req["op"] in ("go", "abort") and rid in waiting:
            pid, w = waiting.pop(rid)
            if req["op"] == "go":
                try:
                    os.write(w, b"g")
                except BrokenPipeError:   # killed from outside before its release: its status is reaped as any
                    pass
            else:
                sigkill(pid, group=req.get("group", False))
            os.close(w)

    def reap() -> None:
        for pid, rc in exited_children():
            if spare is not None and pid == spare.pid:   # died unused: replaced when next asked for
                spare.reaped = True
                continue
            send({"id": running.pop(pid, (None, False))[0], "status": rc})

    buf = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                drain(wake_r)
                continue
            data = os.read(channel.requests, 1 << 16)
            if not data:   # the client is gone: so is everything this server started for it
                if spare is not None:
                    spare.discard()
                for pid, (_, job) in running.items():
                    (kill_tree if job else sigkill)(pid)
                left = reap_killed(running)
                if left:
                    print(f"forkserver: exiting with {len(left)} children not reaped ({', '.join(map(str, left))}): "
                          "they die with it (PR_SET_PDEATHSIG)", file=sys.stderr)
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    handle(json.loads(line))
        reap()


def main(argv: list[str]) -> None:
    """`python -m conformance.run.forkserver --channel=R,W [--tracer=PID] [--later=M1,M2] PRELOAD...`
    (--tracer: the client, whose descendants may ptrace the server, as each child allows its own)"""
    argv = list(argv)
    if not argv or not argv[0].startswith(Channel.OPTION):
        raise SystemExit(f"forkserver: the first argument must be {Channel.OPTION}R,W (its protocol channel)")
    channel = Channel.parse(argv.pop(0).removeprefix(Channel.OPTION))
    if argv and argv[0].startswith("--tracer="):
        allow_tracer(int(argv.pop(0).removeprefix("--tracer=")))
    later = []
    if argv and argv[0].startswith("--later="):
        later = [m for m in argv.pop(0).removeprefix("--later=").split(",") if m]
    serve(channel, argv, later)


if __name__ == "__main__":
    main(sys.argv[1:])
    # Every child has been reaped and nothing is buffered: skip the interpreter's teardown of torch,
    # which every suite run would otherwise wait for once per server.
    sys.stderr.flush()
    os._exit(0)
