"""Warm trial runner: one process imports torch and the trainer's module once, then forks a fresh
child per trainer process.

A fresh interpreter spends seconds importing torch before it trains one step; a fork costs
milliseconds. The parent never runs a tensor op or touches CUDA, so children start with no thread
pools and no device state. Each child blocks on a pipe until released, so strace can attach to it
(`strace -p`) before it runs its first instruction of training: syscall-level crash points work
as on a fresh interpreter, and the suite's tests compare both runners on the same cases.

Protocol (JSON lines on the server's stdin/stdout):
    -> {"op": "fork", "module": M, "argv": [...], "env": {...}, "stderr": PATH}
    <- {"pid": PID}
    -> {"op": "go"}
    <- {"status": RC}          (RC < 0: killed by signal -RC, as subprocess reports it)
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .adapters import TrainerAdapter


def warm_module(adapter: TrainerAdapter) -> tuple[str, list[str]] | None:
    """(module, argv) if the adapter is `python -m module ...` with this interpreter, else None."""
    argv = list(adapter.argv)
    if len(argv) >= 3 and argv[1] == "-m" and os.path.realpath(argv[0]) == os.path.realpath(sys.executable):
        return argv[2], argv[3:]
    return None


# -- server side ----------------------------------------------------------------------------------
def _child(module: str, argv: list[str], env: dict[str, str], stderr_path: str, go_fd: int) -> None:
    os.read(go_fd, 1)
    os.close(go_fd)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module] + argv
    import warnings
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                            category=RuntimeWarning)
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(preload: list[str]) -> None:
    import torch  # noqa: F401  (import only: no tensor op, no CUDA call before forking)
    try:
        # torch imports dynamo lazily on the first optimizer construction: seconds per child
        # unless the parent has imported it (import only; it starts no thread).
        import torch._dynamo  # noqa: F401
    except Exception as exc:
        print(f"forkserver: cannot preload torch._dynamo: {exc!r}", file=sys.stderr)
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception as exc:  # a module that cannot be preloaded is simply imported per child
            print(f"forkserver: cannot preload {module}: {exc!r}", file=sys.stderr)
    out = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] != "fork":
            continue
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            _child(req["module"], req["argv"], req["env"], req["stderr"], r)
        os.close(r)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        go = json.loads(sys.stdin.readline() or '{"op": "abort"}')
        if go.get("op") == "go":
            os.write(w, b"g")
        else:
            os.kill(pid, signal.SIGKILL)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write(json.dumps({"status": rc}) + "\n")
        out.flush()


# -- client side ----------------------------------------------------------------------------------
class ForkServer:
    def __init__(self, preload: list[str]):
        env = dict(os.environ)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        self.proc = subprocess.Popen([sys.executable, "-m", "conformance.forkserver", *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.lock = threading.Lock()

    def _send(self, obj) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("fork server died")
        return json.loads(line)

    def run(self, module: str, argv: list[str], env: dict[str, str], stderr_path: Path,
            attach=None, timeout: float = 300) -> int:
        """Fork a child; `attach(pid)` runs before it is released (e.g. starts strace)."""
        with self.lock:
            self._send({"op": "fork", "module": module, "argv": argv, "env": env, "stderr": str(stderr_path)})
            pid = self._recv()["pid"]
            tracer = None
            try:
                tracer = attach(pid) if attach else None
            except BaseException:
                self._send({"op": "abort"})
                self._recv()
                raise
            self._send({"op": "go"})
            timer = threading.Timer(timeout, lambda: _kill(pid))
            timer.start()
            try:
                status = self._recv()["status"]
            finally:
                timer.cancel()
            if tracer is not None:
                try:
                    tracer.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    tracer.kill()
            return status

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    serve(sys.argv[1:])
