"""The layout protocol: what the catalog, retention, the cold tier and the manager ask of a
checkpoint without knowing how it is stored. Three layouts implement it, each beside its own
format: one file (`single_file.FileLayout`), a sharded directory (`sharded.ShardedLayout`) and a
chained checkpoint (`reference.chain.layout.ChainLayout`). A checkpoint's name says its layout
(names.py); `of(path)` is the one place a path is mapped to its layout, and `named(name)` the one
place a layout's name is: an unknown name is refused there, with the names there are."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from .. import names
from ..chain.layout import ChainLayout
from .sharded import ShardedLayout
from .single_file import FileLayout


class Layout(Protocol):
    """One way of storing a checkpoint. Reading needs no configuration; `save` uses what the
    instance was built with (`for_config`)."""

    name: str               # "file", "sharded" or "chain" (names.LAYOUTS)
    is_directory: bool      # a checkpoint of this layout is a directory, not a file
    meta_in_payload: bool   # `meta` is saved inside the payload (`extra["meta"]`), not beside it

    def path_for(self, directory: Path, step: int) -> Path:
        """Where the checkpoint of `step` lives in `directory`."""

    def save(self, payload: dict[str, Any], path: Path, *, step: int, metric: float | None,
             meta: dict[str, Any]) -> None:
        """Write `payload` (with `meta`: lineage, why it was saved) and commit it at `path`."""

    def open(self, path: Path, map_location=None, *, continue_in=None) -> dict[str, Any]:
        """The verified, migrated payload; a CheckpointError if it is incomplete or damaged.
        `continue_in`: a manager's ChainWriter, which a chained checkpoint tells what the next
        delta is taken against (other layouts leave it as it is)."""

    def verify(self, path: Path) -> None:
        """Raise a CheckpointError unless the checkpoint is complete and every byte intact."""

    def check_committed(self, path: Path) -> dict[str, Any] | None:
        """Retention's cheap check (committed, complete sizes); returns an index `record` may reuse."""

    def record(self, path: Path, index: dict[str, Any] | None = None) -> dict[str, Any]:
        """What the checkpoint stores about itself (`metric`, `meta`), read as cheaply as it allows."""

    def needs(self, path: Path) -> tuple[str, ...]:
        """The checkpoints (names, this one included) it cannot be loaded without."""

    def remove(self, path: Path) -> None:
        """Un-commit first, then delete, so a crash midway leaves no half-valid checkpoint."""

    def sweep(self, directory: Path) -> list[Path]:
        """After removals: delete what no remaining checkpoint of this layout uses."""


_READERS: dict[str, Layout] = {"file": FileLayout(), "sharded": ShardedLayout(), "chain": ChainLayout()}


def named(name: str) -> Layout:
    """The reading instance of the layout called `name`; a ValueError for a name that is none."""
    try:
        return _READERS[name]
    except (KeyError, TypeError):   # TypeError: an unhashable name
        raise ValueError(f"layout must be one of {', '.join(map(repr, names.LAYOUTS))}, got {name!r}") from None


def for_config(name: str, *, num_shards: int, group_by, max_workers: int | None, chain_writer) -> Layout:
    """The layout a CheckpointManager saves with: sharded with its shard plan, chained with the
    manager's ChainWriter (which owns what the next delta is taken against)."""
    if name == "sharded":
        return ShardedLayout(num_shards=num_shards, group_by=group_by, max_workers=max_workers)
    if name == "chain":
        return ChainLayout(chain_writer)
    return named(name)


def of(path: str | os.PathLike) -> Layout:
    """The layout of the checkpoint at `path`, by its name."""
    return named(names.layout_of(Path(path).name))
