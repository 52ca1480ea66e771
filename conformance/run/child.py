"""Run a Python adapter's `run(ctx)` as a trainer process: `python -m conformance.run.child pkg.mod:attr`."""
from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import threading

from conformance.model.adapters import load_object
from conformance.model.context import RunContext


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m conformance.run.child package.module:attribute", file=sys.stderr)
        return 2
    obj = load_object(argv[0])
    result = obj.run(RunContext.from_env())
    return int(result or 0)


# run_target's status for a KeyboardInterrupt nothing caught: a fresh interpreter then ends by
# SIGINT (its status as subprocess reports it), which exit_like_interpreter reproduces.
INTERRUPTED = -signal.SIGINT


def run_target(module: str, argv: list[str], env: dict[str, str], kind: str = "module") -> int:
    """Run a trainer given as a module (`python -m`) or a script (`python train.py`) in this
    process, with exactly `env` as its environment, as `__main__`; its exit status (1 and the
    traceback on stderr for an exception, INTERRUPTED for Ctrl-C). A warm fork server's child and
    a warm rank use it, then end with exit_like_interpreter."""
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        if kind == "script":   # as `python script.py`: its directory first on sys.path
            sys.argv = [module] + argv
            sys.path.insert(0, os.path.dirname(module))
            runpy.run_path(module, run_name="__main__")
        else:
            sys.argv = [module] + argv
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        import traceback
        traceback.print_exc()
        code = INTERRUPTED if isinstance(exc, KeyboardInterrupt) else 1
    return code


def forget_parents_finalizers() -> None:
    """Keep the `weakref.finalize` callbacks this process inherited from its fork server from
    running at its exit: they belong to the server's objects (torch.library's registrations, whose
    removal at exit is module teardown a trainer never observes, and nearly all of what the
    interpreter-like exit took; a temporary directory a library made at import, which the first
    child to exit would delete under the server and every later child). Those the child makes
    itself run at its exit, as in a fresh interpreter."""
    import weakref
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        finalizer.atexit = False


def exit_like_interpreter(code: int):
    """End this process as a fresh interpreter ends once its main module is done, less the
    teardown of its modules (seconds for torch's, and nothing a trainer observes): wait for its
    non-daemon threads, after what they registered to run first (a ThreadPoolExecutor finishes the
    work queued on it: an async save handed to one is written), run its atexit handlers, flush its
    standard streams, then exit with `code` (INTERRUPTED: by SIGINT). A process that exits at once
    instead would drop a save a fresh interpreter completes."""
    try:
        try:
            threading._shutdown()
        except BaseException:
            import traceback
            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if code == INTERRUPTED:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
