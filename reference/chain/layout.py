"""The chained layout as the catalog sees it (layouts.kinds.Layout): `step-N.chain.json`, a
manifest over the shared piece store. Saving goes through the manager's ChainWriter (write.py),
which owns what the next delta is taken against; a checkpoint needs its ancestors (gc.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..layouts.base import LayoutBase
from . import gc
from .read import load_chain, open_chain, read_chain, read_manifest
from .write import ChainWriter


class ChainLayout(LayoutBase):
    meta_in_payload = False
    name, is_directory = "chain", False

    def __init__(self, writer: ChainWriter | None = None):
        self.writer = writer     # None: a reader (the catalog's), which cannot save

    def save(self, payload: dict[str, Any], path: Path, *, step: int, metric: float | None,
             meta: dict[str, Any]) -> None:
        if self.writer is None:
            raise TypeError("a chained checkpoint is saved through a CheckpointManager (its ChainWriter)")
        self.writer.save(payload, step, metric, meta)

    def open(self, path: Path, map_location=None, *, continue_in: ChainWriter | None = None) -> dict[str, Any]:
        if continue_in is None:
            return load_chain(path, map_location)
        opened = open_chain(path, map_location)
        continue_in.follow(continue_in.directory, opened.last, opened.base)
        return opened.payload

    def verify(self, path: Path) -> None:
        load_chain(path, map_location="cpu", migrate_schema=False)

    def check_committed(self, path: Path) -> None:
        read_chain(path)

    def record(self, path: Path, index: dict[str, Any] | None = None) -> dict[str, Any]:
        return read_manifest(path)[0]

    def needs(self, path: Path) -> tuple[str, ...]:
        return tuple(p.name for p in gc.ancestors(path)) or (path.name,)

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def sweep(self, directory: Path) -> list[Path]:
        return gc.sweep(directory)
