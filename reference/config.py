"""CheckpointManager's settings as one validated, typed record: when to save, how a checkpoint is laid
out, what retention keeps, and where the cold tier is. Every bad value is refused here, before anything
is written, with what was given and what is allowed."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .chain.codec import Compression
from .chain.read import STRATEGIES
from .layouts import kinds
from .layouts.sharded import GroupBy
from .loop import triggers
from .retention import check_keep_last


def _positive_int(name: str, value: Any, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 ({meaning}), got {value!r}")


@dataclasses.dataclass(frozen=True)
class ManagerConfig:
    """What `CheckpointManager(directory, **options)` takes, as one record (`CheckpointManager(directory,
    config)`). `layout` defaults to "chain" when `strategy` or `compression` is given, else "sharded"."""

    every_steps: int | None = None
    every_seconds: float | None = None
    trigger: triggers.Trigger | None = None
    keep_last: int | None = None
    keep_best: int | None = None
    best_mode: str = "min"
    layout: str | None = None
    num_shards: int = 2
    group_by: GroupBy | str | None = None
    max_workers: int | None = None
    strategy: str | None = None
    full_every: int = 10
    compression: int | Compression | None = None
    cold: str | None = None
    keep_hot: int = 1
    cold_timeout_s: float = 10.0
    storage_options: dict[str, Any] | None = None

    def __post_init__(self):
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}: use one of {', '.join(map(repr, STRATEGIES))}")
        _positive_int("full_every", self.full_every, "a full checkpoint every K saves")
        chained = self.strategy is not None or self.compression is not None
        if self.layout is None:
            object.__setattr__(self, "layout", "chain" if chained else "sharded")
        kinds.named(self.layout)   # refuses a name that is no layout
        if chained and self.layout != "chain":
            raise ValueError(f"strategy and compression need the chained layout, not layout={self.layout!r}")
        if isinstance(self.compression, bool) or not isinstance(self.compression, (int, Compression, type(None))):
            raise ValueError(f"compression must be a zstd level (int) or a Compression, got {self.compression!r}")
        if isinstance(self.compression, int):
            object.__setattr__(self, "compression", Compression(level=self.compression))
        check_keep_last(self.keep_last)
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        _positive_int("keep_hot", self.keep_hot, "checkpoints kept on local disk")
        if self.trigger is not None and (self.every_steps is not None or self.every_seconds is not None):
            raise ValueError("give either trigger= or every_steps/every_seconds, not both")

    def make_trigger(self, clock: Callable[[], float]) -> triggers.Trigger:
        """The trigger given, else every_steps and/or every_seconds, whichever comes first (neither: forced
        saves only)."""
        if self.trigger is not None:
            return self.trigger
        parts = ([triggers.every_steps(self.every_steps)] if self.every_steps else []) \
            + ([triggers.every_seconds(self.every_seconds, clock=clock)] if self.every_seconds else [])
        return parts[0] if len(parts) == 1 else triggers.any_of(*parts)
