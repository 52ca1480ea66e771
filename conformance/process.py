"""What a trainer process is given (the command contract's values) and what it leaves behind."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The command contract's numbers for one run (the checkpoint dir and loss log vary per process)."""

    total_steps: int
    save_every: int
    seed: int

    def env(self, ckpt_dir: Path, loss_log: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"CONFORMANCE_CKPT_DIR": str(ckpt_dir),
                    "CONFORMANCE_TOTAL_STEPS": str(self.total_steps),
                    "CONFORMANCE_SAVE_EVERY": str(self.save_every),
                    "CONFORMANCE_SEED": str(self.seed),
                    "CONFORMANCE_LOSS_LOG": str(loss_log)})
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Writing .pyc files adds open/write calls to the first run only, which would shift the
        # per-thread syscall counts that crash points are addressed by.
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env

    def describe(self) -> str:
        return f"total_steps={self.total_steps} save_every={self.save_every} seed={self.seed}"


@dataclasses.dataclass
class ProcessResult:
    returncode: int
    losses: dict[int, float]
    stderr: str
    trace_text: str = ""
    killed: bool = False       # killed by the suite at a crash point
    seconds: float = 0.0
    overrun: str = ""          # why the suite stopped it early (a time limit), if it did
    stopped: str = ""          # a planned stop by the suite (after a step, after a grace period)

    @property
    def first_step(self) -> int | None:
        return min(self.losses) if self.losses else None

    def resumed_from(self, spec: RunSpec) -> int:
        """The step this process resumed from (0: fresh); for a process that trained nothing,
        total_steps if it exited 0 (nothing left to do), else -1 (it did not start)."""
        if self.first_step is not None:
            return self.first_step - 1
        return spec.total_steps if self.returncode == 0 else -1


def read_losses(path: Path) -> dict[int, float]:
    """Parse the loss log; a torn last line (the process was killed mid-write) is ignored."""
    losses: dict[int, float] = {}
    if not path.exists():
        return losses
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            losses[int(rec["step"])] = float(rec["loss"])
        except (ValueError, KeyError, TypeError):
            continue
    return losses
