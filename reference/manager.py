"""CheckpointManager: step-named checkpoints, cadence, retention and verified `latest()`.

Ordering is by the step number parsed from the name, never by string. Retention runs only after
the new checkpoint is committed and never deletes the newest valid checkpoint.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from .atomic import fsync_dir, is_temp_name, remove_stale_temps
from .errors import CheckpointError, write_error
from .index import INDEX_NAME
from .index import read_index
from .sharded import GroupBy, check_sizes, load_sharded, save_sharded, verify_sharded
from .single_file import load_file, save_file

_NAME_RE = re.compile(r"^step-(?P<step>\d+)(?P<ext>\.pt)?$")


class CheckpointSkippedWarning(UserWarning):
    """A checkpoint was passed over because it failed verification."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path

    @property
    def layout(self) -> str:
        return "file" if self.path.suffix == ".pt" else "sharded"


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Every step-named entry (committed or not), oldest first by step number."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in os.scandir(directory):
        m = _NAME_RE.match(entry.name)
        if m is None or is_temp_name(entry.name):
            continue
        is_dir = entry.is_dir(follow_symlinks=False)
        if (m.group("ext") is None) != is_dir:
            continue
        found.append(CheckpointInfo(int(m.group("step")), Path(entry.path)))
    return sorted(found, key=lambda c: (c.step, c.path.name))


def verify(info_or_path: CheckpointInfo | str | os.PathLike) -> None:
    """Raise a CheckpointError if the checkpoint is not complete and intact."""
    path = info_or_path.path if isinstance(info_or_path, CheckpointInfo) else Path(info_or_path)
    if path.is_dir():
        verify_sharded(path)
    else:
        load_file(path, map_location="cpu")


def load(path: str | os.PathLike, map_location=None) -> dict[str, Any]:
    """Load (verified, migrated) a checkpoint of either layout."""
    path = Path(path)
    return load_sharded(path, map_location) if path.is_dir() else load_file(path, map_location)


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


class CheckpointManager:
    """Save on a cadence (every N steps or T seconds, whichever first), keep the last K (and the
    best K by a metric), and find the newest valid checkpoint."""

    def __init__(self, directory: str | os.PathLike, *, every_steps: int | None = None,
                 every_seconds: float | None = None, keep_last: int | None = None,
                 keep_best: int | None = None, best_mode: str = "min", layout: str = "sharded",
                 num_shards: int = 2, group_by: GroupBy | str | None = None,
                 max_workers: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if layout not in ("sharded", "file"):
            raise ValueError(f"layout must be 'sharded' or 'file', got {layout!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1: retention never leaves zero checkpoints")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        self.directory = Path(directory)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.best_mode = best_mode
        self.layout = layout
        self.num_shards = num_shards
        self.group_by = group_by
        self.max_workers = max_workers
        self.clock = clock
        self._last_save_time = clock()
        self.directory.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.directory)

    # -- cadence ---------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and self.clock() - self._last_save_time >= self.every_seconds

    def path_for(self, step: int) -> Path:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        name = f"step-{step:08d}" + (".pt" if self.layout == "file" else "")
        return self.directory / name

    # -- saving ----------------------------------------------------------------------------
    def save(self, payload: dict[str, Any], *, step: int | None = None, metric: float | None = None,
             force: bool = False) -> Path | None:
        """Save if the cadence says so (or `force`); then apply retention. Returns the path."""
        if step is None:
            step = int(payload["counters"]["global_step"])
        if not force and not self.should_save(step):
            return None
        path = self.path_for(step)
        extra = dict(payload.get("extra") or {})
        if metric is not None:
            if not isinstance(metric, (int, float)) or math.isnan(metric):
                raise ValueError(f"metric must be a real number, got {metric!r}")
            extra["metric"] = float(metric)
        payload = {**payload, "extra": extra}
        if self.layout == "file":
            save_file(payload, path)
        else:
            save_sharded(payload, path, num_shards=self.num_shards, group_by=self.group_by,
                         max_workers=self.max_workers)
        self._last_save_time = self.clock()
        try:
            self.apply_retention(just_saved=path)
        except OSError as exc:   # the new checkpoint is committed; an old one may be half deleted
            raise write_error(path, exc, committed=True) from exc
        return path

    # -- finding ---------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        return list_checkpoints(self.directory)

    def latest(self) -> CheckpointInfo | None:
        return latest_valid(self.directory)

    def load_latest(self, map_location=None) -> dict[str, Any] | None:
        """Payload of the newest checkpoint that verifies and loads; None if there is none."""
        for info in reversed(self.checkpoints()):
            try:
                return load(info.path, map_location)
            except CheckpointError as exc:
                warnings.warn(f"skipping checkpoint {info.path}: {exc}", CheckpointSkippedWarning, stacklevel=2)
        return None

    # -- retention -------------------------------------------------------------------------
    def _metric(self, info: CheckpointInfo) -> float | None:
        try:
            if info.layout == "sharded":
                value = read_index(info.path).get("metric")
            else:
                value = (load_file(info.path, "cpu").get("extra") or {}).get("metric")
        except CheckpointError:
            return None
        return float(value) if isinstance(value, (int, float)) else None

    def apply_retention(self, *, just_saved: Path | None = None) -> list[Path]:
        """Delete checkpoints beyond keep_last/keep_best. Only committed checkpoints count toward
        what is kept; incomplete ones older than the anchor are removed.

        The anchor is never deleted: the checkpoint just saved (`just_saved`), else the newest
        checkpoint that fully verifies. Committed-looking checkpoints are only size-checked here
        (cheap), so without an anchor a newer checkpoint with a flipped bit could take the last
        kept slot and retention would delete the only loadable one. If nothing verifies, nothing
        is deleted."""
        if self.keep_last is None and self.keep_best is None:
            return []
        infos = self.checkpoints()
        valid: list[CheckpointInfo] = []
        invalid: list[CheckpointInfo] = []
        for info in infos:
            try:
                _check_committed(info)
                valid.append(info)
            except CheckpointError:
                invalid.append(info)
        if not valid:
            return []
        anchor = next((i for i in valid if just_saved is not None and i.path == Path(just_saved)), None)
        if anchor is None:
            for info in reversed(valid):
                try:
                    verify(info)
                except CheckpointError:
                    continue
                anchor = info
                break
            else:
                return []
        keep = {anchor.path}
        if self.keep_last is not None:
            keep.update(i.path for i in valid[-self.keep_last:])
        if self.keep_best:
            scored = [(m, i) for i in valid if (m := self._metric(i)) is not None]
            scored.sort(key=lambda mi: mi[0], reverse=self.best_mode == "max")
            keep.update(i.path for _, i in scored[:self.keep_best])
        doomed = [i for i in valid if i.path not in keep]
        doomed += [i for i in invalid if i.step < anchor.step]
        removed = []
        for info in sorted(doomed, key=lambda i: i.step):
            _remove_checkpoint(info.path)
            removed.append(info.path)
        if removed:
            fsync_dir(self.directory)
        return removed


def _check_committed(info: CheckpointInfo) -> None:
    """Retention's check: committed and complete (index and sizes; a single file exists by
    atomic rename). Full hash verification is left to loading, so retention stays cheap."""
    if info.layout == "sharded":
        check_sizes(info.path)
    elif not info.path.is_file():
        raise CheckpointError(info.path, "not a regular file")


def _remove_checkpoint(path: Path) -> None:
    """Un-commit first (index.json), then delete, so a crash midway leaves no half-valid entry."""
    if path.is_dir():
        index = path / INDEX_NAME
        if index.exists():
            index.unlink()
            fsync_dir(path)
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
