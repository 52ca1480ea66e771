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

Protocol (JSON lines on the server's stdin/stdout; several children may run at once):
    -> {"op": "fork", "id": I, "module": M, "argv": [...], "env": {...}, "stderr": PATH, "tracer": PID
        [, "then": {...}][, "job": [torchrun flags]]}
       ("tracer": the process whose descendants may ptrace the child (Yama's PR_SET_PTRACER);
        "then": run the module a second time in the same child, with that environment;
        "job": run it as a torchrun job with those flags)
    <- {"id": I, "pid": PID}        (or {"id": I, "refused": WHY}: the server cannot fork safely)
    -> {"op": "go", "id": I}        (or {"op": "abort", "id": I}: kill it unreleased)
    <- {"id": I, "status": RC}      (RC < 0: killed by signal -RC, as subprocess reports it)
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
from .forked import SpareChild
from .proctree import kill_tree, sigkill
from .warmup import LIBRARY_THREADS, UNEXPLAINED_THREADS, huge_page_tunables, thread_count, warm_up
from .zygote import drain, exited_children


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


def serve(preload: list[str], later: list[str] = ()) -> None:
    """Single-threaded (forking from a threaded process is unsafe): a select loop over requests on
    stdin and SIGCHLD (through a wakeup pipe); several children may run at once. When stdin closes
    (the client is gone, however it ended), every child still running is killed (a job: its whole
    process group) and reaped before the server exits: nothing it started outlives it."""
    warm_up(preload, later)
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
    running: dict[int, tuple[object, bool]] = {}   # pid -> (request id, whether it is a job's group)
    waiting: dict[object, tuple[int, int]] = {}    # request id -> (pid, write end of its go pipe)

    def send(obj) -> None:
        os.write(1, (json.dumps(obj) + "\n").encode())

    def fork_spare() -> SpareChild | None:
        if fork_problem() is not None:
            return None
        return SpareChild.fork((wake_r, wake_w, *(gw for _, gw in waiting.values())))

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
                child.hand(req)
            running[child.pid] = (rid, req.get("job") is not None)
            waiting[rid] = (child.pid, child.go)
            send({"id": rid, "pid": child.pid})
            spare = fork_spare()
        elif req["op"] in ("go", "abort") and rid in waiting:
            pid, w = waiting.pop(rid)
            if req["op"] == "go":
                os.write(w, b"g")
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
            data = os.read(stdin_fd, 1 << 16)
            if not data:   # the client is gone: so is everything this server started for it
                if spare is not None:
                    spare.discard()
                for pid, (_, job) in running.items():
                    (kill_tree if job else sigkill)(pid)
                while running:
                    try:
                        pid, _ = os.waitpid(-1, 0)
                    except ChildProcessError:
                        break
                    running.pop(pid, None)
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    handle(json.loads(line))
        reap()


def main(argv: list[str]) -> None:
    """`python -m conformance.run.forkserver [--later=M1,M2] PRELOAD...`"""
    later = []
    if argv and argv[0].startswith("--later="):
        later = [m for m in argv.pop(0).removeprefix("--later=").split(",") if m]
    serve(argv, later)


if __name__ == "__main__":
    main(sys.argv[1:])
    # Every child has been reaped and nothing is buffered: skip the interpreter's teardown of torch,
    # which every suite run would otherwise wait for once per server.
    sys.stderr.flush()
    os._exit(0)
