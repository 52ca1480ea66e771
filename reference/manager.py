"""CheckpointManager: step-named checkpoints, cadence, retention and verified `latest()`.

Ordering is by the step number parsed from the name, never by string. Retention runs only after
the new checkpoint is committed and never deletes the newest valid checkpoint, nor anything a kept
checkpoint's chain needs. Layouts: one file (`step-N.pt`), a sharded directory (`step-N/`), or a
chained checkpoint (`step-N.chain.json` over a shared piece store; chain.py) that can be full,
incremental or differential, and compressed. `save(..., blocking=False)` persists a CPU copy in
a background thread.
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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from . import chain, chain_write, tree
from .atomic import fsync_dir, is_temp_name, remove_stale_temps
from .codec import Compression
from .errors import CheckpointError, write_error
from .index import INDEX_NAME
from .index import read_index
from .sharded import GroupBy, check_sizes, load_sharded, save_sharded, verify_sharded
from .single_file import load_file, save_file

_NAME_RE = re.compile(r"^step-(?P<step>[0-9]+)(?P<ext>\.pt|\.chain\.json)?$")


class CheckpointSkippedWarning(UserWarning):
    """A checkpoint was passed over because it failed verification."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path

    @property
    def layout(self) -> str:
        if self.path.name.endswith(chain.SUFFIX):
            return "chain"
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
    elif path.name.endswith(chain.SUFFIX):
        chain.load_chain(path, map_location="cpu", migrate_schema=False)
    else:
        load_file(path, map_location="cpu")


def load(path: str | os.PathLike, map_location=None) -> dict[str, Any]:
    """Load (verified, migrated) a checkpoint of either layout."""
    path = Path(path)
    if path.is_dir():
        return load_sharded(path, map_location)
    if path.name.endswith(chain.SUFFIX):
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


class CheckpointManager:
    """Save on a cadence (every N steps or T seconds, whichever first), keep the last K (and the
    best K by a metric), and find the newest valid checkpoint.

    `strategy` ("full", "incremental" or "differential") or `compression` (a zstd level, or a
    codec.Compression) selects the chained layout: incremental saves what changed since the
    previous checkpoint, differential what changed since the last full one, and every
    `full_every`-th checkpoint is full, which bounds the chain a restore reads."""

    def __init__(self, directory: str | os.PathLike, *, every_steps: int | None = None,
                 every_seconds: float | None = None, keep_last: int | None = None,
                 keep_best: int | None = None, best_mode: str = "min", layout: str | None = None,
                 num_shards: int = 2, group_by: GroupBy | str | None = None,
                 max_workers: int | None = None, strategy: str | None = None, full_every: int = 10,
                 compression: int | Compression | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if strategy is not None and strategy not in chain.STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(map(repr, chain.STRATEGIES))}")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be an integer >= 1 (a full checkpoint every K saves), got {full_every!r}")
        chained = strategy is not None or compression is not None
        if layout is None:
            layout = "chain" if chained else "sharded"
        if layout not in ("sharded", "file", "chain"):
            raise ValueError(f"layout must be 'sharded', 'file' or 'chain', got {layout!r}")
        if chained and layout != "chain":
            raise ValueError(f"strategy and compression need the chained layout, not layout={layout!r}")
        if isinstance(compression, bool) or not isinstance(compression, (int, Compression, type(None))):
            raise ValueError(f"compression must be a zstd level (int) or a Compression, got {compression!r}")
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
        self.strategy = strategy or "full"
        self.full_every = full_every
        self.compression = Compression(level=compression) if isinstance(compression, int) else compression
        self._last_save_time = clock()
        self.directory.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.directory)
        # Chained layout: what the next delta is taken against (set by a save or a load).
        self._last: chain.Parent | None = None
        self._base: chain.Parent | None = None
        self.last_save: chain_write.SaveResult | None = None
        # blocking=False: one background writer, at most one save in flight.
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    # -- cadence ---------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and self.clock() - self._last_save_time >= self.every_seconds

    def path_for(self, step: int) -> Path:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if self.layout == "chain":
            return self.directory / chain.manifest_name(step)
        name = f"step-{step:08d}" + (".pt" if self.layout == "file" else "")
        return self.directory / name

    # -- saving ----------------------------------------------------------------------------
    def save(self, payload: dict[str, Any], *, step: int | None = None, metric: float | None = None,
             force: bool = False, blocking: bool = True) -> Path | None:
        """Save if the cadence says so (or `force`); then apply retention. Returns the path.

        With `blocking=False` the payload's tensors are copied to CPU memory, the save and its
        retention run in a background thread, and the path is returned at once; the checkpoint
        is committed (and seen by `latest()`) only when that finishes. A save waits for the one
        before it, and the background save's error is raised by the next `save()` or `wait()`."""
        self.wait()
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
        self._last_save_time = self.clock()
        if not blocking:
            snapshot = tree.cpu_copy(payload)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-save")
            self._pending = self._executor.submit(self._save_now, snapshot, path, step, metric)
            return path
        return self._save_now(payload, path, step, metric)

    def wait(self) -> Path | None:
        """Finish the save in flight (blocking=False), if any; returns its path, or None. Its
        error, if it failed, is raised here (once)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Wait for a save in flight and stop the background writer."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _save_now(self, payload: dict[str, Any], path: Path, step: int, metric: float | None) -> Path:
        if self.layout == "file":
            save_file(payload, path)
        elif self.layout == "sharded":
            save_sharded(payload, path, num_shards=self.num_shards, group_by=self.group_by,
                         max_workers=self.max_workers)
        else:
            self._save_chained(payload, step, metric)
        try:
            self.apply_retention(just_saved=path)
        except OSError as exc:   # the new checkpoint is committed; an old one may be half deleted
            raise write_error(path, exc, committed=True) from exc
        return path

    def next_kind(self) -> tuple[str, chain.Parent | None]:
        """What the next chained save will be: full, or a delta and the checkpoint it is taken
        against (the previous one, or for differential the last full one)."""
        last = self._last
        if self.strategy == "full" or last is None or last.since_full + 1 >= self.full_every:
            return "full", None
        parent = last if self.strategy == "incremental" else self._base
        if parent is None or not (self.directory / parent.name).exists():
            return "full", None
        return self.strategy, parent

    def _save_chained(self, payload: dict[str, Any], step: int, metric: float | None) -> None:
        kind, parent = self.next_kind()
        result = chain_write.save_chain(payload, self.directory, step, kind=kind, parent=parent,
                                  since_full=0 if parent is None else self._last.since_full + 1,
                                  compression=self.compression, max_workers=self.max_workers, metric=metric,
                                  # Rows are taken against the previous checkpoint (incremental) or
                                  # the last full one (differential); never for strategy "full".
                                  keep_rows=self.strategy == "incremental"
                                  or (self.strategy == "differential" and kind == "full"))
        self._last = result.parent
        if kind == "full":
            self._base = result.parent
        elif self.strategy == "incremental":
            self._base = None     # never a parent again; the chain's root stays on disk
        self.last_save = result

    # -- finding ---------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        return list_checkpoints(self.directory)

    def latest(self) -> CheckpointInfo | None:
        return latest_valid(self.directory)

    def load_latest(self, map_location=None) -> dict[str, Any] | None:
        """Payload of the newest checkpoint that verifies and loads; None if there is none. A
        chained checkpoint loaded here is what this manager's next delta is taken against."""
        self.wait()
        for info in reversed(self.checkpoints()):
            try:
                if info.layout != "chain":
                    return load(info.path, map_location)
                opened = chain.open_chain(info.path, map_location)
            except CheckpointError as exc:
                warnings.warn(f"skipping checkpoint {info.path}: {exc}", CheckpointSkippedWarning, stacklevel=2)
                continue
            self._last, self._base = opened.last, opened.base
            return opened.payload
        return None

    # -- retention -------------------------------------------------------------------------
    def _metric(self, info: CheckpointInfo) -> float | None:
        try:
            if info.layout == "sharded":
                value = read_index(info.path).get("metric")
            elif info.layout == "chain":
                value = chain.read_manifest(info.path)[0].get("metric")
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
        # A kept chained checkpoint needs its whole chain.
        keep.update(p for kept in list(keep) if kept.name.endswith(chain.SUFFIX) for p in chain.ancestors(kept))
        doomed = [i for i in valid if i.path not in keep]
        doomed += [i for i in invalid if i.step < anchor.step and i.path not in keep]
        removed = []
        for info in sorted(doomed, key=lambda i: i.step):
            _remove_checkpoint(info.path)
            removed.append(info.path)
        if removed:
            fsync_dir(self.directory)   # the manifests are gone for good before their pieces go
        if any(i.layout == "chain" for i in infos):
            removed += chain.sweep(self.directory)
        return removed


def _check_committed(info: CheckpointInfo) -> None:
    """Retention's check: committed and complete (index and sizes; a single file exists by
    atomic rename). Full hash verification is left to loading, so retention stays cheap."""
    if info.layout == "sharded":
        check_sizes(info.path)
    elif info.layout == "chain":
        chain.read_chain(info.path)
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
