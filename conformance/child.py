"""Run a Python adapter's `run(ctx)` as a trainer process: `python -m conformance.child pkg.mod:attr`."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from conformance.adapters import load_object


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
    def from_env(cls) -> "RunContext":
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
        print("usage: python -m conformance.child package.module:attribute", file=sys.stderr)
        return 2
    obj = load_object(argv[0])
    result = obj.run(RunContext.from_env())
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
