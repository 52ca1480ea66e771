"""What checkpoints a directory holds: their names and steps, whether each is committed and
intact, what each records about itself (metric, lineage, why it was saved), and removing one.

Ordering is by the step number parsed from the name, never by string. Layouts: one file
(`step-N.pt`), a sharded directory (`step-N/`), or a chained checkpoint (`step-N.chain.json`
over a shared piece store); each is asked through the layout protocol (layouts/kinds.py), never
branched on here.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from . import names
from .errors import CheckpointError
from .layouts import kinds
from .primitives.atomic import fsync_dir


class CheckpointSkippedWarning(UserWarning):
    """A checkpoint was passed over because it failed verification."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path

    @property
    def layout(self) -> str:
        return kinds.of(self.path).name


def list_checkpoints(directory: str | os.PathLike, *, layout: str | None = None) -> list[CheckpointInfo]:
    """Every step-named entry (committed or not), oldest first by step number; of one `layout`
    only, if given. The one listing of a directory's checkpoints, the multi-rank managers' too: an
    entry counts only if it is what its layout (`kinds.of`) stores, a directory itself (not a link
    to one) or a file, and two names of one step (`step-5`, `step-00000005`) are both listed."""
    only = None if layout is None else kinds.named(layout).name
    found = []
    for entry in names.step_entries(directory):
        kind = kinds.named(entry.layout)   # the layout its name says, parsed once by the scan
        if kind.is_directory == entry.is_dir and only in (None, kind.name):
            found.append(CheckpointInfo(entry.step, entry.path))
    return found


def verify(info_or_path: CheckpointInfo | str | os.PathLike) -> None:
    """Raise a CheckpointError if the checkpoint is not complete and intact."""
    path = info_or_path.path if isinstance(info_or_path, CheckpointInfo) else Path(info_or_path)
    kinds.of(path).verify(path)


def load(path: str | os.PathLike, map_location=None) -> dict[str, Any]:
    """Load (verified, migrated) a checkpoint of any layout."""
    path = Path(path)
    return kinds.of(path).open(path, map_location)


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
    """Retention's check: committed and complete (a sharded index and its file sizes, a chain's
    manifests; a single file exists by atomic rename). Full hash verification is left to
    loading, so retention stays cheap. Returns the index it read, if any, which `read_meta` can
    take instead of reading it again."""
    return kinds.of(info.path).check_committed(info.path)


def remove_checkpoint(path: Path) -> None:
    """Un-commit first (a sharded index), then delete, so a crash midway leaves no half-valid entry."""
    kinds.of(path).remove(path)


def remove_checkpoints(directory: Path, paths: list[Path], layouts: Iterable[str]) -> list[Path]:
    """Retention's deletion, one rule for every caller: remove `paths` in the order given (oldest
    first), make the removals durable, then sweep, for each layout in `layouts` (those present
    before), the pieces no remaining checkpoint uses (a chain's). The paths removed or swept."""
    removed = []
    for path in paths:
        remove_checkpoint(path)
        removed.append(path)
    if removed:
        fsync_dir(directory)   # the manifests are gone for good before their pieces go
    for layout in sorted(set(layouts)):
        removed += kinds.named(layout).sweep(directory)
    return removed


def read_meta(info: CheckpointInfo, index: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the checkpoint records about itself, read cheaply where the layout allows (the
    index or manifest): `metric`, and `meta` (lineage, why it was saved, best). `index`: a
    sharded checkpoint's index as `check_committed` just read it. Raises CheckpointError if it
    cannot be read."""
    record = kinds.of(info.path).record(info.path, index)
    out = dict(record.get("meta") or {}) if isinstance(record.get("meta"), dict) else {}
    value = record.get("metric")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out["metric"] = float(value)
    return out
