"""Which checkpoints retention keeps: one rule for the hot directory and for hot and cold together.

Kept: the newest `keep_last` by step number, the best `keep_best` by metric, the checkpoint the
metric trigger marked best most recently (keep-best is never rotated away), the anchor (the
checkpoint just saved, or the newest that verifies), the steps other branches grew from, and
everything a kept checkpoint needs (a chained checkpoint's parents).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from .catalog import CheckpointInfo, check_committed, read_meta
from .errors import CheckpointError
from .layouts import kinds


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    step: int
    metric: float | None = None
    best: bool = False                 # marked best by the metric trigger when it was saved
    needs: tuple[str, ...] = ()        # names of the checkpoints it cannot load without


def needs_of(info: CheckpointInfo) -> tuple[str, ...]:
    """The checkpoints `info` cannot load without, itself included (a chain's ancestors)."""
    return kinds.of(info.path).needs(info.path)


def candidate(name: str, step: int, meta: dict, needs: tuple[str, ...]) -> Candidate:
    trigger = meta.get("trigger") if isinstance(meta.get("trigger"), dict) else {}
    metric = meta.get("metric")
    return Candidate(name, step, float(metric) if isinstance(metric, (int, float)) else None,
                     bool(trigger.get("best")), needs)


@dataclasses.dataclass(frozen=True)
class Held:
    """A committed checkpoint of the hot directory as retention sees it."""

    info: CheckpointInfo
    meta: dict[str, Any]             # what it records about itself (read_meta; {} if unreadable)
    needs: tuple[str, ...]

    @property
    def candidate(self) -> Candidate:
        return candidate(self.info.path.name, self.info.step, self.meta, self.needs)


def committed(infos: Iterable[CheckpointInfo]) -> tuple[dict[str, Held], list[CheckpointInfo]]:
    """The committed checkpoints among `infos` by name (each index read once: check_committed
    hands it to read_meta), and the ones that are not committed."""
    held: dict[str, Held] = {}
    invalid: list[CheckpointInfo] = []
    for info in infos:
        try:
            index = check_committed(info)
        except CheckpointError:
            invalid.append(info)
            continue
        try:
            meta = read_meta(info, index)
        except CheckpointError:
            meta = {}
        held[info.path.name] = Held(info, meta, needs_of(info))
    return held, invalid


def check_keep_last(keep_last: Any) -> None:
    """The one rule for a `keep_last` setting, for every manager: None (keep everything) or an
    integer >= 1 (a bool is not one); a ValueError naming what was given otherwise."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an integer >= 1 (retention never leaves zero checkpoints), "
                         f"got {keep_last!r}")


def keep_set(candidates: Iterable[Candidate], *, keep_last: int | None, keep_best: int | None,
             best_mode: str = "min", anchor: str | None = None, protect_steps: set[int] = frozenset()) -> set[str]:
    """Names to keep among `candidates` (committed checkpoints). With neither keep_last nor
    keep_best, everything is kept."""
    ordered = sorted(candidates, key=lambda c: (c.step, c.name))
    if keep_last is None and keep_best is None:
        return {c.name for c in ordered}
    keep = {c.name for c in ordered if c.step in protect_steps}
    if anchor is not None:
        keep.add(anchor)
    if keep_last is not None:
        keep.update(c.name for c in ordered[-keep_last:])
    if keep_best:
        scored = sorted((c for c in ordered if c.metric is not None), key=lambda c: c.metric,
                        reverse=best_mode == "max")
        keep.update(c.name for c in scored[:keep_best])
    marked = [c for c in ordered if c.best]
    if marked:
        keep.add(marked[-1].name)
    by_name = {c.name: c for c in ordered}
    for name in list(keep):
        if name in by_name:
            keep.update(by_name[name].needs)
    return keep
