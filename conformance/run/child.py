"""Run a Python adapter's `run(ctx)` as a trainer process: `python -m conformance.run.child pkg.mod:attr`."""
from __future__ import annotations

import dataclasses
import json
import os
import runpy
import sys
from pathlib import Path

from conformance.model.adapters import load_object


@dataclasses.dataclass
class RunContext:
    """The command contract's five values, plus a loss logger that follows the contract."""

    ckpt_dir: Path
    total_steps: int
    save_every: int
    seed: int
    loss_log: Path

    def __post_init__(self):
        self._log = None

    @classmethod
    def from_env(cls) -> RunContext:
        e = os.environ
        return cls(Path(e["CONFORMANCE_CKPT_DIR"]), int(e["CONFORMANCE_TOTAL_STEPS"]),
                   int(e["CONFORMANCE_SAVE_EVERY"]), int(e["CONFORMANCE_SEED"]),
                   Path(e["CONFORMANCE_LOSS_LOG"]))

    def log_step(self, step: int, loss: float) -> None:
        """Append and flush `{"step": s, "loss": x}` before returning."""
        if self._log is None:
            self._log = open(self.loss_log, "a", buffering=1)
        self._log.write(json.dumps({"step": int(step), "loss": float(loss)}) + "\n")
        self._log.flush()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m conformance.run.child package.module:attribute", file=sys.stderr)
        return 2
    obj = load_object(argv[0])
    result = obj.run(RunContext.from_env())
    return int(result or 0)


def run_target(module: str, argv: list[str], env: dict[str, str], kind: str = "module") -> int:
    """Run a trainer given as a module (`python -m`) or a script (`python train.py`) in this
    process, with exactly `env` as its environment, as `__main__`; its exit status (1 and the
    traceback on stderr for an exception). A warm fork server's child and a warm rank use it."""
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
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
