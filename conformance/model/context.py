"""The command contract in code: `RunContext`, every value a trainer process is given (what a
Python adapter's `run(ctx)` receives; a trainer command reads the same from its environment), and
the `Trainer` protocol an adapter object follows.

How the suite calls a trainer, in every process it starts (a run is one or more processes, each a
fresh interpreter or a fork of one that only imported modules; some are killed on purpose):

1. `adapter.run(ctx)` is called once, on the process's main thread.
2. The trainer resumes from the newest *valid* checkpoint in `ctx.ckpt_dir` (with capability
   `resume_from`: the step `ctx.resume_from` names, when set), else starts fresh from `ctx.seed`.
3. After every optimizer step s (1-based, global): `ctx.log_step(s, loss)`, before anything of
   step s+1 and before step s's checkpoint is saved.
4. After every step s with `s % ctx.save_every == 0`: a checkpoint of the state after step s.
5. At `ctx.total_steps` it returns 0 (or None). A start whose newest checkpoint is at
   `total_steps` trains nothing and returns 0; a non-zero int or an exception fails the process.
6. A checkpoint it cannot trust is never loaded: it falls back to an older valid one, or fails
   with a message.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

from .digest import state_digest
from .process import loss_record


@dataclasses.dataclass
class RunContext:
    """The command contract's values (docs/running.md, "The command contract"), and a loss logger
    that follows it."""

    ckpt_dir: Path          # CONFORMANCE_CKPT_DIR: the run's checkpoints, the same for every process of it
    total_steps: int        # CONFORMANCE_TOTAL_STEPS: train until the global step equals this
    save_every: int         # CONFORMANCE_SAVE_EVERY: save after every step s with s % save_every == 0
    seed: int               # CONFORMANCE_SEED: for a fresh start
    loss_log: Path          # CONFORMANCE_LOSS_LOG: log_step appends here
    cold_url: str | None = None        # CONFORMANCE_COLD_URL (capability cold_tier): where cold copies go
    shared_dir: Path | None = None     # CONFORMANCE_SHARED_DIR (node_local_storage): what every node sees
    resume_from: int | None = None     # CONFORMANCE_RESUME_FROM (capability resume_from): the step to resume
    hang_timeout: float | None = None  # CONFORMANCE_HANG_TIMEOUT: the longest a rank should wait for a peer
    rank: int = 0           # RANK (torchrun's): this process's rank
    world_size: int = 1     # WORLD_SIZE (torchrun's): how many ranks the job has

    def __post_init__(self):
        self._log = None
        self._restored: dict[str, str] | None = None

    @classmethod
    def from_env(cls, env=None) -> RunContext:
        e = os.environ if env is None else env
        optional = lambda name, kind: kind(e[name]) if e.get(name) else None  # noqa: E731
        return cls(Path(e["CONFORMANCE_CKPT_DIR"]), int(e["CONFORMANCE_TOTAL_STEPS"]),
                   int(e["CONFORMANCE_SAVE_EVERY"]), int(e["CONFORMANCE_SEED"]), Path(e["CONFORMANCE_LOSS_LOG"]),
                   cold_url=e.get("CONFORMANCE_COLD_URL") or None, shared_dir=optional("CONFORMANCE_SHARED_DIR", Path),
                   resume_from=optional("CONFORMANCE_RESUME_FROM", int),
                   hang_timeout=optional("CONFORMANCE_HANG_TIMEOUT", float),
                   rank=int(e.get("RANK", 0)), world_size=int(e.get("WORLD_SIZE", 1)))

    def log_step(self, step: int, loss: float, state: dict[str, str] | None = None) -> None:
        """Append and flush `{"step": s, "loss": x}` before returning; with `state` (digests of the
        state after the step: ctx.state_digest(...)) as its "state"."""
        restored, self._restored = self._restored, None
        self._write(loss_record(step, loss, state=state, restored=restored))

    def log_resumed(self, step: int, state: dict[str, str]) -> None:
        """After restoring step `step`, right before training step + 1: the state's digests (sent
        with step + 1's line, one line per step)."""
        self._restored = dict(state)

    @staticmethod
    def state_digest(**components) -> dict[str, str]:
        """conformance.contract.state_digest: `{name: digest}` of model, optimizer, rng=True, ..."""
        return state_digest(**components)

    def _write(self, record: dict) -> None:
        if self._log is None:
            self._log = open(self.loss_log, "a", buffering=1)
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()


@runtime_checkable
class Trainer(Protocol):
    """What `--adapter=package.module:attribute` names: an object with `run(ctx)`, following the
    call sequence above. Optional attributes: `name` (str, shown in reports), `capabilities`
    (names from conformance.Capability), `steps` (runs of that many steps instead of 14),
    `world_size` and `nnodes` (a torchrun job), `legacy_samples`, `version`."""

    def run(self, ctx: RunContext) -> int | None: ...
