"""What checkpoints a directory holds: their names and steps, whether each is committed and
intact, what each records about itself (metric, lineage, why it was saved), and removing one.

Ordering is by the step number parsed from the name, never by string. Layouts: one file
(`step-N.pt`), a sharded directory (`step-N/`), or a chained checkpoint (`step-N.chain.json`
over a shared piece store; chain.py).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from . import names
from .chain import read as chain
from .errors import CheckpointError
from .layouts.index import INDEX_NAME, read_index
from .layouts.sharded import check_sizes, load_sharded, verify_sharded
from .layouts.single_file import load_file
from .primitives.atomic import fsync_dir, is_temp_name


class CheckpointSkippedWarning(UserWarning):
    """A checkpoint was passed over because it failed verification."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path

    @property
    def layout(self) -> str:
        return names.layout_of(self.path.name)


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Every step-named entry (committed or not), oldest first by step number."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in os.scandir(directory):
        parsed = names.parse(entry.name)
        if parsed is None or is_temp_name(entry.name):
            continue
        if (parsed[1] == "sharded") != entry.is_dir(follow_symlinks=False):
            continue
        found.append(CheckpointInfo(parsed[0], Path(entry.path)))
    return sorted(found, key=lambda c: (c.step, c.path.name))


def verify(info_or_path: CheckpointInfo | str | os.PathLike) -> None:
    """Raise a CheckpointError if the checkpoint is not complete and intact."""
    path = info_or_path.path if isinstance(info_or_path, CheckpointInfo) else Path(info_or_path)
    if path.is_dir():
        verify_sharded(path)
    elif names.layout_of(path.name) == "chain":
        chain.load_chain(path, map_location="cpu", migrate_schema=False)
    else:
        load_file(path, map_location="cpu")


def load(path: str | os.PathLike, map_location=None) -> dict[str, Any]:
    """Load (verified, migrated) a checkpoint of either layout."""
    path = Path(path)
    if path.is_dir():
        return load_sharded(path, map_location)
    if names.layout_of(path.name) == "chain":
        return chain.load_chain(path, map_location)
    return load_file(path, map_location)


def latest_valid(directory: str | os.PathLike) -> CheckpointInfo | None:
    """Newest checkpoint that verifies; each one skipped is named in a warning."""
    for info in reversed(list_checkpoints(directory)):
        try:
            verify(info)
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint {info.path}: {exc}", CheckpointSkippedWarning, stacklevel=2)
            continue
        return info
    return None




def check_committed(info: CheckpointInfo) -> dict[str, Any] | None:
    """Retention's check: committed and complete (index and sizes; a single file exists by
    atomic rename). Full hash verification is left to loading, so retention stays cheap.
    Returns the index it read (sharded), which `read_meta` can take instead of reading it again."""
    if info.layout == "sharded":
        return check_sizes(info.path)
    if info.layout == "chain":
        chain.read_chain(info.path)
    elif not info.path.is_file():
        raise CheckpointError(info.path, "not a regular file")
    return None


def remove_checkpoint(path: Path) -> None:
    """Un-commit first (index.json), then delete, so a crash midway leaves no half-valid entry."""
    if path.is_dir():
        index = path / INDEX_NAME
        if index.exists():
            index.unlink()
            fsync_dir(path)
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


_FILE_META: dict[tuple[str, int, int], dict[str, Any]] = {}


def read_meta(info: CheckpointInfo, index: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the checkpoint records about itself, read cheaply where the layout allows (the
    index or manifest): `metric`, and `meta` (lineage, why it was saved, best). `index`: a
    sharded checkpoint's index as `check_committed` just read it. Raises CheckpointError if it
    cannot be read."""
    if info.layout == "sharded":
        record = index if index is not None else read_index(info.path)
    elif info.layout == "chain":
        record = chain.read_manifest(info.path)[0]
    else:
        # A single file holds it in its payload: loaded once per process (a committed file is
        # never rewritten in place; its size and mtime name this version of it).
        try:
            st = os.stat(info.path)
        except OSError as exc:
            raise CheckpointError(info.path, f"cannot read: {exc}") from None
        key = (os.fspath(info.path), st.st_size, st.st_mtime_ns)
        if key not in _FILE_META:
            if len(_FILE_META) > 256:
                _FILE_META.clear()
            _FILE_META[key] = load_file(info.path, "cpu").get("extra") or {}
        record = _FILE_META[key]
    out = dict(record.get("meta") or {}) if isinstance(record.get("meta"), dict) else {}
    value = record.get("metric")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out["metric"] = float(value)
    return out
