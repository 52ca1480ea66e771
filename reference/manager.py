"""CheckpointManager: step-named checkpoints, save triggers, retention, lineage, a cold tier, and
a verified `load_latest()`.

Retention runs only after the new checkpoint is committed and never deletes the newest valid
checkpoint, the best one, a branch point, nor anything a kept checkpoint's chain needs. Layouts:
one file (`step-N.pt`), a sharded directory (`step-N/`), or a chained checkpoint
(`step-N.chain.json` over a shared piece store; chain.py) that can be full, incremental or
differential, and compressed. `save(..., blocking=False)` persists a CPU copy in a background
thread. With `cold=URL`, committed checkpoints are uploaded in the background and all but the
newest `keep_hot` leave the local disk once their upload is verified (tiering.py). Every
checkpoint records its lineage (lineage.py); `load(resume_from=step)` starts a new branch.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import lineage
from .catalog import (
    CheckpointInfo,
    CheckpointSkippedWarning,
    latest_valid,
    list_checkpoints,
    load,
    read_meta,
    remove_checkpoints,
    verify,
)
from .chain import read as chain
from .chain import write as chain_write
from .cold import demotion as tiering
from .cold.store import ColdTier
from .config import ManagerConfig
from .errors import CheckpointError, write_error
from .layouts import kinds
from .loop import triggers
from .primitives import tree
from .primitives.atomic import remove_stale_temps
from .retention import committed, keep_set

__all__ = ["CheckpointInfo", "CheckpointManager", "CheckpointSkippedWarning", "latest_valid", "list_checkpoints",
           "load", "verify"]


class TriggerChangedWarning(UserWarning):
    """The loaded checkpoint was saved under another trigger configuration."""


class CheckpointManager:
    """Save when a trigger says so (every N steps, every T seconds, when a metric improves, or
    a hybrid), keep the last K (the best K by a metric, and the one the metric trigger marked
    best), and find the newest valid checkpoint, in either tier.

    `strategy` ("full", "incremental" or "differential") or `compression` (a zstd level, or a
    codec.Compression) selects the chained layout: incremental saves what changed since the
    previous checkpoint, differential what changed since the last full one, and every
    `full_every`-th checkpoint is full, which bounds the chain a restore reads.

    `cold` (any fsspec URL: s3://bucket/prefix, file:///path, ...) adds a cold tier; `keep_hot`
    checkpoints stay on local disk. `cold_timeout_s` bounds every call to the store.

    The options are a `ManagerConfig` (config.py), given as keywords or as one record."""

    def __init__(self, directory: str | os.PathLike, config: ManagerConfig | None = None, *,
                 clock: Callable[[], float] = time.time, **options: Any):
        if config is not None and options:
            raise TypeError(f"give either a ManagerConfig or keyword options, not both (got {sorted(options)})")
        self.config = config = config if config is not None else ManagerConfig(**options)
        self.run_dir = Path(directory)
        self.keep_last, self.keep_best, self.best_mode = config.keep_last, config.keep_best, config.best_mode
        self.layout, self.num_shards, self.group_by = config.layout, config.num_shards, config.group_by
        self.max_workers, self.compression, self.keep_hot = config.max_workers, config.compression, config.keep_hot
        self.trigger = config.make_trigger(clock)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The cold tier is opened (and proven reachable) before anything is written here.
        self.cold = ColdTier(config.cold, timeout_s=config.cold_timeout_s,
                             storage_options=config.storage_options) if config.cold else None
        if self.cold is not None:
            tiering.restore_run_records(self.cold, self.run_dir)
        self.branch = lineage.read_head(self.run_dir)
        self.directory = lineage.branch_dir(self.run_dir, self.branch)
        self.directory.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.directory)
        # Lineage: the run's id and the checkpoint the training state came from.
        self.run_id: str | None = None
        self._lineage_parent: str | None = None
        # Chained layout: what the next delta is taken against (set by a save or a load).
        self.chain = chain_write.ChainWriter(self.directory, config.strategy or "full", config.full_every,
                                             self.compression, self.max_workers)
        self._layout = kinds.for_config(self.layout, num_shards=self.num_shards, group_by=self.group_by,
                                        max_workers=self.max_workers, chain_writer=self.chain)
        self.loaded_meta: dict[str, Any] = {}
        # blocking=False: one background writer, at most one save in flight.
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        # The cold tier's passes run in one background thread; saves and deletions of pieces
        # never overlap (the store lock).
        self._store_lock = tiering.StoreLock() if self.cold is not None else contextlib.nullcontext()
        self._tier = tiering.Worker(self._tier_pass)
        self.last_tier_pass: tiering.PassResult | None = None

    # -- triggers ---------------------------------------------------------------------------
    def should_save(self, step: int, metrics: Mapping[str, float] | None = None) -> bool:
        return self.trigger.decide(step, metrics).save

    def path_for(self, step: int) -> Path:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        return self._layout.path_for(self.directory, step)

    # -- saving ----------------------------------------------------------------------------
    def save(self, payload: dict[str, Any], *, step: int | None = None, metric: float | None = None,
             metrics: Mapping[str, float] | None = None, force: bool = False, blocking: bool = True) -> Path | None:
        """Save if the trigger says so (or `force`); then apply retention. Returns the path.

        `metrics` are what the trigger looks at (e.g. {"val_loss": 0.41}); `metric` is recorded
        for keep_best (the metric trigger's value if not given). Why the checkpoint was saved,
        the trigger's state and the checkpoint's lineage are recorded in it.

        With `blocking=False` the payload's tensors are copied to CPU memory, the save and its
        retention run in a background thread, and the path is returned at once; the checkpoint
        is committed (and seen by `latest()`) only when that finishes. A save waits for the one
        before it, and the background save's error (or the cold tier's) is raised by the next
        `save()` or `wait()`."""
        self.wait()
        if step is None:
            step = int(payload["counters"]["global_step"])
        path = self.path_for(step)
        decision = self.trigger.decide(step, metrics, force=force)
        if not decision.save:
            return None
        if metric is None:
            metric = decision.metric
        extra = dict(payload.get("extra") or {})
        if metric is not None:
            if not isinstance(metric, (int, float)) or math.isnan(metric):
                raise ValueError(f"metric must be a real number, got {metric!r}")
            extra["metric"] = float(metric)
        if self.run_id is None:
            self.run_id = lineage.new_run_id()
        own_id = lineage.checkpoint_id(self.branch, step)
        parent = self._lineage_parent if self._lineage_parent != own_id else None
        record = lineage.Lineage(own_id, parent, self.run_id, self.branch)
        meta = {"lineage": record.to_json(), "trigger": self.trigger.record(decision)}
        payload = {**payload, "extra": extra}

        def committed() -> None:
            self.trigger.committed(decision)
            self._lineage_parent = own_id
        if not blocking:
            snapshot = tree.cpu_copy(payload)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-save")
            self._pending = self._executor.submit(self._save_now, snapshot, path, step, metric, meta, committed)
            return path
        return self._save_now(payload, path, step, metric, meta, committed)

    def wait(self) -> Path | None:
        """Finish the save in flight (blocking=False), if any; returns its path, or None. Its
        error, if it failed, is raised here (once), and so is a cold-tier pass's."""
        pending, self._pending = self._pending, None
        done = None if pending is None else pending.result()
        self._tier.raise_error()
        return done

    def wait_tiering(self) -> tiering.PassResult | None:
        """Finish the cold tier's uploads, retention and demotions requested so far; raise their
        error, if any. Returns the last pass's result."""
        self.wait()
        self._tier.wait()
        return self.last_tier_pass

    def close(self) -> None:
        """Wait for a save in flight and the cold tier's work, then stop the background threads."""
        try:
            self.wait()
            if self.cold is not None:
                self.wait_tiering()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._tier.shutdown()

    def _save_now(self, payload: dict[str, Any], path: Path, step: int, metric: float | None,
                  meta: dict[str, Any] | None = None, committed: Callable[[], None] = lambda: None) -> Path:
        with self._store_lock:
            self._layout.save(payload, path, step=step, metric=metric, meta=meta or {})
        committed()
        if self.cold is not None:     # retention over both tiers runs with the uploads
            self.request_tiering()
            return path
        try:
            self.apply_retention(just_saved=path)
        except OSError as exc:   # the new checkpoint is committed; an old one may be half deleted
            raise write_error(path, exc, committed=True) from exc
        return path

    def next_kind(self) -> tuple[str, chain.Parent | None]:
        return self.chain.next_kind()

    @property
    def last_save(self) -> chain_write.SaveResult | None:
        """The last chained save's result (what it wrote)."""
        return self.chain.last_save

    # -- the cold tier ----------------------------------------------------------------------
    def request_tiering(self) -> None:
        """Run a cold-tier pass in the background (one more after the current one, if busy)."""
        if self.cold is not None:
            self._tier.request()

    def _tier_pass(self) -> None:
        policy = tiering.Policy(self.keep_last, self.keep_best, self.best_mode, self.keep_hot)
        self.last_tier_pass = tiering.run_pass(self.cold, self.run_dir, self.branch, policy, self._store_lock)

    # -- finding and loading ---------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        return list_checkpoints(self.directory)

    def latest(self) -> CheckpointInfo | None:
        return latest_valid(self.directory)

    def load_latest(self, map_location=None) -> dict[str, Any] | None:
        """Payload of the newest checkpoint on this branch's line that verifies and loads, hot or
        cold (a cold one is fetched back first); None if there is none. What it restores: the
        trigger's state, the lineage parent, and for a chained checkpoint what the next delta is
        taken against."""
        self.wait_tiering()       # no pass runs while checkpoints are fetched and opened
        try:
            for found in tiering.along_line(self.run_dir, self.branch, self.cold):
                try:
                    return self._open(found, map_location)
                except CheckpointError as exc:
                    where = found.hot.path if found.hot is not None else f"{found.id} (cold)"
                    warnings.warn(f"skipping checkpoint {where}: {exc}", CheckpointSkippedWarning, stacklevel=2)
            return None
        finally:
            self.request_tiering()    # uploads a previous process left unfinished

    def load(self, *, resume_from: int, branch: str | None = None, map_location=None) -> dict[str, Any]:
        """Resume from the checkpoint of step `resume_from` on this branch's line. If it is not
        the newest there, a new branch starts from it (named `branch`, or branch-N): later saves
        go to the branch and the old line's checkpoints are never touched. A restart given the
        same `resume_from` continues the branch it made. NoSuchCheckpointError if no checkpoint
        of that step exists on the line."""
        if branch is not None:
            lineage.check_branch_name(branch)
        self.wait_tiering()
        line = tiering.along_line(self.run_dir, self.branch, self.cold)
        target = next((f for f in line if f.step == resume_from), None)
        if target is None:
            steps = sorted({f.step for f in line})
            raise lineage.NoSuchCheckpointError(self.run_dir, f"resume_from={resume_from!r}: no checkpoint of that step "
                                                f"on branch {self.branch!r} (its line has steps {steps})")
        current = lineage.read_branch(self.run_dir, self.branch)
        if current is not None and current.parent_id == target.id and branch in (None, self.branch):
            payload = self.load_latest(map_location)
            if payload is not None:
                return payload
        payload = self._open(target, map_location)
        if target is not line[0] or branch is not None:
            made = lineage.create_branch(self.run_dir, target.id, branch)
            lineage.write_head(self.run_dir, made.name)
            self.branch, self.directory = made.name, made.directory
            self.chain.follow(self.directory)       # the new branch starts with a full checkpoint
        self.request_tiering()                      # (after the branch exists: its point is kept)
        return payload

    def _open(self, found: tiering.Found, map_location) -> dict[str, Any]:
        path = tiering.materialize(found, self.cold)
        layout = kinds.of(path)
        if found.directory == self.directory:     # a chain's next delta is taken against it
            payload = layout.open(path, map_location, continue_in=self.chain)
        else:                                     # from elsewhere: the next chained save is full
            payload = layout.open(path, map_location)
            self.chain.follow(self.directory)
        extra = payload.get("extra") if isinstance(payload.get("extra"), dict) else {}
        meta = extra.pop("meta", None) if layout.meta_in_payload else read_meta(CheckpointInfo(found.step, path))
        meta = meta if isinstance(meta, dict) else {}
        record = lineage.Lineage.from_json(meta.get("lineage"), path)
        self.loaded_meta = meta           # lineage and why it was saved: what `log` shows
        self.run_id = record.run if record is not None else self.run_id
        self._lineage_parent = found.id
        self._restore_trigger(meta.get("trigger"), path)
        return payload

    def _restore_trigger(self, record: Any, path: Path) -> None:
        """The trigger carries on from the loaded checkpoint's state (last save step and time,
        best metric), so a resumed run decides as the uninterrupted one. A checkpoint saved
        under another trigger configuration leaves this one as it starts, with a warning."""
        if not isinstance(record, dict) or record.get("state") is None:
            return
        if record.get("trigger") != self.trigger.describe():
            warnings.warn(f"{path}: saved under trigger {record.get('trigger')!r}, now {self.trigger.describe()!r}: "
                          "its state (last save, best metric) is not carried over", TriggerChangedWarning, stacklevel=3)
            return
        try:
            self.trigger.load_state_dict(record["state"])
        except triggers.TriggerStateError as exc:
            raise triggers.TriggerStateError(f"{path}: {exc}") from None

    # -- retention -------------------------------------------------------------------------
    def apply_retention(self, *, just_saved: Path | None = None) -> list[Path]:
        """Delete checkpoints beyond keep_last/keep_best (hot tier only; with a cold tier the
        background pass does this over both). Only committed checkpoints count toward what is
        kept; incomplete ones older than the anchor are removed.

        The anchor is never deleted: the checkpoint just saved (`just_saved`), else the newest
        checkpoint that fully verifies. Committed-looking checkpoints are only size-checked here
        (cheap), so without an anchor a newer checkpoint with a flipped bit could take the last
        kept slot and retention would delete the only loadable one. If nothing verifies, nothing
        is deleted."""
        if self.keep_last is None and self.keep_best is None:
            return []
        infos = self.checkpoints()
        held, invalid = committed(infos)
        valid = [h.info for h in held.values()]
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
        keep = keep_set([h.candidate for h in held.values()], keep_last=self.keep_last, keep_best=self.keep_best,
                        best_mode=self.best_mode, anchor=anchor.path.name,
                        protect_steps=lineage.branch_points(self.run_dir, self.branch))
        doomed = [i for i in valid if i.path.name not in keep]
        doomed += [i for i in invalid if i.step < anchor.step and i.path.name not in keep]
        return remove_checkpoints(self.directory, [i.path for i in sorted(doomed, key=lambda i: i.step)],
                                  [i.layout for i in infos])
