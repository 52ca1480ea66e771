"""Development harness only: a root that forks fork servers for the suite processes this
project's tests start. One process imports torch and loads what every fork server loads, then
forks each fork server a suite process asks for, in place of a fresh interpreter that imports it
all again.

Why only here: the project's tests start about a hundred suite processes per test worker, each
with its own fork servers; a team's run starts one suite process per xdist worker, whose servers
would wait for a root to start as long as for themselves (docs/running.md, "The process tree").

A suite process's ForkServer (conformance/run/forkclient.py) uses a root when
CONFORMANCE_FORK_ROOT names it and it runs the same interpreter with the same `conformance`, torch
and numpy, as the same user, in the same environment (its PYTHONHASHSEED included) but for the
suite's own variables and PYTHONPATH; otherwise, or if no root can be reached, its fork servers
start as fresh interpreters. The dev conftest runs two roots per test worker, with two hash
secrets: a run's saving and resuming processes come from servers with different ones.

Protocol, one connection per server: the client sends one JSON line (argv: the server's
arguments but its channel, env, cwd, extra_path: PYTHONPATH's entries, executable, modules) with
the server's channel (the read end of its request pipe, the write end of its reply pipe) and its
stderr as SCM_RIGHTS; the root answers {"pid": PID} or {"refused": why}. The forked server is made
to look like `python -m conformance.run.forkserver --channel=R,W ARGV...` started by the client:
its environment, directory, sys.path, argv, channel and stderr (the server points its stdin and
stdout away itself, as a fresh one does). It is the root's child
(reaped by the root); the client waits on it through a pidfd. The root exits when its stdin
closes.

    python -m tests.forkroot @name     (from the repository root)
"""
from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys

from conformance.run import forkserver
from conformance.run.forkclient import socket_address
from conformance.run.warmup import warm_up

MAX_REQUEST = 1 << 22
# sys.path of `python -m` without PYTHONPATH, less its first entry (the directory it started in).
_OWN_EXTRA = {os.path.abspath(p or ".") for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)} \
    if "PYTHONPATH" in os.environ else set()
BASE_PATH = [p for p in sys.path[1:] if p not in _OWN_EXTRA]
START_ENV = dict(os.environ)
# Variables that may differ between the root and a client: the suite's and pytest's own, the
# path (given to each server), and two that torch reads only when asked, never as it loads:
# TORCHINDUCTOR_CACHE_DIR (torch sets it in its process's environment when inductor first asks for
# its cache) and PYTORCH_NVML_BASED_CUDA_CHECK (read by each torch.cuda.is_available() and
# device_count(); importing lightning sets it in its process's environment).
OWN_VARIABLES = ("CONFORMANCE_", "PYTEST_", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK")


def _refusal(req: dict) -> str | None:
    """Why the root cannot stand in for a fresh interpreter of this client, or None."""
    exe = os.path.abspath(req.get("executable") or "")
    # Another name for this binary in its directory (python, python3) is this interpreter; a link
    # to it from elsewhere (a venv) has other site packages.
    ours = sys.executable
    if os.path.dirname(exe) != os.path.dirname(ours) or os.path.realpath(exe) != os.path.realpath(ours):
        return f"the root runs {sys.executable}, not {exe}"
    # torch, numpy and their libraries read the environment as they load (OMP_NUM_THREADS,
    # PYTHONHASHSEED, LD_PRELOAD, ...): any variable the suite's own do not explain must be as here.
    env = req.get("env", {})
    differs = sorted(k for k in {*env, *START_ENV}
                     if env.get(k) != START_ENV.get(k) and not k.startswith(OWN_VARIABLES))
    if differs:
        return f"its environment differs from the root's in {', '.join(differs[:5])}"
    for name, path in req.get("modules", {}).items():   # conformance, torch, numpy as the client imported them
        ours = getattr(sys.modules.get(name), "__file__", None)
        if ours != path:
            return f"the root imported {name} from {ours}, the client from {path}"
    return None


def _stranger(conn: socket.socket) -> str | None:
    """A client of another user is refused: the root would run its modules as this user."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return None if uid == os.getuid() else f"the client runs as uid {uid}, the root as {os.getuid()}"


def _become_server(req: dict, fds: list[int], closing: list[int]) -> None:
    """In the forked child: look like a fork server started fresh by the client, then serve."""
    for fd in closing:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    requests, replies, stderr = fds
    os.dup2(stderr, 2)
    os.close(stderr)
    argv = [forkserver.Channel(requests, replies).option(), *req["argv"]]
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.path[:] = [req["cwd"], *req["extra_path"], *BASE_PATH]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    sys.argv[:] = [forkserver.__file__, *argv]
    code = 0
    try:
        forkserver.main(argv)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)   # as forkserver's __main__: no teardown of torch


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, more, _, _ = socket.recv_fds(conn, 1 << 16, 8)
        if not chunk:
            break
        data += chunk
        fds += more
        if len(data) > MAX_REQUEST:
            break
    return json.loads(data), fds


def serve_root(address: str) -> None:
    """Accept requests on the Unix socket `address` ("@name": abstract) until stdin closes."""
    warm_up([], ROOT_PRELOAD)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_address(address))
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # the servers are reaped as they exit
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.fileobj is not listener:
                if not os.read(sys.stdin.fileno(), 1 << 12):
                    return
                continue
            conn, _ = listener.accept()
            with conn:
                fds: list[int] = []
                try:
                    req, fds = _read_request(conn)
                    why = _stranger(conn) or _refusal(req) or (
                        None if len(fds) == 3 else f"{len(fds)} fds sent, not 3")
                    if why is not None:
                        conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
                        continue
                    pid = os.fork()
                    if pid == 0:
                        _become_server(req, fds, [listener.fileno(), conn.fileno(), sel.fileno(), sys.stdin.fileno()])
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except (OSError, ValueError) as exc:
                    print(f"forkroot: a request failed: {exc!r}", file=sys.stderr)
                finally:
                    for fd in fds:
                        os.close(fd)


# What the root loads, out of sight, for every server it forks: torch's lazy modules (warmup.py)
# and the job servers' launcher and collectives. A server for a single process has the job modules
# too, loaded and hidden (no thread, no socket), as its children do.
ROOT_PRELOAD = list(forkserver.JOB_PRELOAD)


if __name__ == "__main__":
    serve_root(sys.argv[1])
    sys.stderr.flush()
    os._exit(0)
