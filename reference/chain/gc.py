"""A chain store as a whole: which manifests a checkpoint needs (`ancestors`, what retention must
keep with it), which manifests a directory holds, and the pieces none of them lists (`orphans`,
removed by retention's `sweep` and by `fsck --gc`)."""
from __future__ import annotations

import os
from pathlib import Path

from .. import names
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..primitives.atomic import is_live_temp
from .read import pieces_dir, read_manifest, references


def ancestors(path: Path) -> list[Path]:
    """The manifests `path` needs (itself included), as far as they can be read."""
    out = [path]
    try:
        manifest, _ = read_manifest(path)
    except CorruptCheckpointError:
        return out
    except IncompleteCheckpointError:
        return []
    seen = {path.name}
    while manifest.get("parent") is not None:
        nxt = path.with_name(manifest["parent"]["name"])
        if nxt.name in seen:
            break
        seen.add(nxt.name)
        try:
            manifest, _ = read_manifest(nxt)
        except (CorruptCheckpointError, IncompleteCheckpointError):
            break
        out.append(nxt)
    return out


def manifests(directory: Path) -> list[Path]:
    """The chain manifests in `directory`, oldest first by step number (names' one scan)."""
    return [e.path for e in names.step_entries(directory) if e.layout == "chain" and e.path.is_file()]


def orphans(directory: Path) -> tuple[list[Path], int]:
    """Pieces no readable manifest in `directory` lists (and this library's stale temp files in
    the store), and the number of manifests that could not be read (whose pieces count as
    orphans: nothing can tell what they held)."""
    store = pieces_dir(directory)
    if not store.is_dir():
        return [], 0
    live: set[str] = set()
    unreadable = 0
    for path in manifests(directory):
        try:
            live |= references(read_manifest(path)[0])
        except (CorruptCheckpointError, IncompleteCheckpointError):
            unreadable += 1
    out = [Path(e.path) for e in os.scandir(store) if e.name not in live and not is_live_temp(e.name)]
    return sorted(out), unreadable


def sweep(directory: Path) -> list[Path]:
    """Remove the pieces no manifest lists (retention's sweep, after the manifests it removed are
    gone for good). Only called between saves, so no piece of a save in progress is touched."""
    removed = []
    for path in orphans(directory)[0]:
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
