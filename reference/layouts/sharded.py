"""Sharded checkpoints: plan the shards, write them (and meta.pt) atomically in parallel while
hashing, then commit by writing index.json last. Loading verifies every size and hash first.

Layout of one checkpoint directory:
    model-00000-of-00004.pt ...   parameters and buffers, split into shards of balanced bytes, or by group
    meta.pt                       everything else: optimizer, scheduler, counters, RNG, ...
    index.json                    schema, names, byte sizes and sha256 of every file (commit point)
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptCheckpointError, IncompleteCheckpointError, write_error
from ..primitives.atomic import atomic_write, atomic_write_bytes, fsync_dir, remove_stale_temps
from ..primitives.integrity import SizeChanged, read_hashed, sha256_file
from ..primitives.loading import safe_torch_load
from ..primitives.schema import check_supported, migrate
from .base import LayoutBase
from .index import INDEX_NAME, META_NAME, build_index, encode_index, read_index

GroupBy = Callable[[str], str]
_GROUP_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def by_suffix(key: str) -> str:
    """Group parameters by their last dotted component: weight, bias, running_mean, ..."""
    return key.rsplit(".", 1)[-1]


def plan_shards(keys: list[str], num_shards: int = 2, group_by: GroupBy | str | None = None,
                sizes: dict[str, int] | None = None) -> dict[str, list[str]]:
    """Map shard file name -> parameter keys, one shard per group when `group_by` is given
    ("suffix" or a function key -> group name), else `num_shards` shards: balanced by bytes when
    `sizes` (key -> byte count) is given, round-robin otherwise. Keys keep their order within a
    shard.

    Balancing matters because shards are written, hashed and read in parallel: round-robin over
    a model's alternating weight/bias keys puts nearly every weight into one shard."""
    if group_by is None:
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if sizes is None:
            buckets = [keys[i::num_shards] for i in range(num_shards)]
        else:
            # Largest first onto the shard with the fewest bytes (then fewest keys): greedy LPT.
            loads = [(0, 0)] * num_shards
            owner: dict[str, int] = {}
            for key in sorted(keys, key=lambda k: -sizes.get(k, 0)):
                i = min(range(num_shards), key=loads.__getitem__)
                owner[key] = i
                loads[i] = (loads[i][0] + sizes.get(key, 0), loads[i][1] + 1)
            buckets = [[] for _ in range(num_shards)]
            for key in keys:
                buckets[owner[key]].append(key)
        plan = {f"model-{i:05d}-of-{num_shards:05d}.pt": buckets[i] for i in range(num_shards)}
    else:
        fn = by_suffix if group_by == "suffix" else group_by
        if not callable(fn):
            raise ValueError(f"group_by must be 'suffix' or a callable, got {group_by!r}")
        plan = {}
        for key in keys:
            group = _GROUP_SAFE.sub("_", str(fn(key))) or "_"
            plan.setdefault(f"model-{group}.pt", []).append(key)
    return {name: ks for name, ks in plan.items() if ks}


_OWN_FILE_RE = re.compile(r"^model-.+\.pt$")


def save_sharded(payload: dict[str, Any], directory: str | os.PathLike, *, num_shards: int = 2,
                 group_by: GroupBy | str | None = None, max_workers: int | None = None,
                 record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `payload` as a sharded checkpoint in `directory`; returns the committed index.
    `record` (lineage, why it was saved) goes in the index as "meta", readable without loading.

    Arguments are checked before anything on disk changes. If the save fails before its commit
    point (a write error, a full disk, an exception in a writer thread), the files it wrote are
    removed again, and the directory too if this save created it: nothing is left at a final name.
    A crash (no chance to clean up) leaves an uncommitted directory that loaders ignore.
    """
    check_supported(payload.get("schema"), os.fspath(directory))
    model = payload.get("model")
    if not isinstance(model, dict) or not all(isinstance(k, str) for k in model):
        raise ValueError("payload['model'] must be a dict with string keys (a state dict)")
    plan_shards(list(model.keys()), num_shards, group_by)  # raises ValueError on bad arguments
    directory = Path(directory)
    created = not directory.exists()
    try:
        return _write_sharded(payload, directory, num_shards=num_shards, group_by=group_by,
                              max_workers=max_workers, record=record)
    except BaseException as exc:
        _discard_uncommitted(directory, created)
        if isinstance(exc, OSError):   # a file's error, reported for the checkpoint as a whole
            raise write_error(directory, exc, committed=(directory / INDEX_NAME).exists()) from exc
        raise


def _discard_uncommitted(directory: Path, created: bool) -> None:
    """After a failed save: if index.json is absent (nothing was committed), remove what the save
    wrote. (If the commit itself went through and only the final directory fsync failed, the
    checkpoint is complete and stays.)"""
    if not directory.is_dir() or (directory / INDEX_NAME).exists():
        return
    if created:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for entry in os.scandir(directory):
        if entry.name == META_NAME or _OWN_FILE_RE.match(entry.name):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _write_sharded(payload: dict[str, Any], directory: str | os.PathLike, *, num_shards: int = 2,
                   group_by: GroupBy | str | None = None, max_workers: int | None = None,
                   record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `payload` as a sharded checkpoint in `directory`; returns the committed index.

    A crash at any instant leaves either no index.json (incomplete, ignored by loaders) or a
    complete, verified checkpoint. If the directory already held a committed checkpoint it is
    un-committed first, so a half-overwritten directory never passes for a valid one.
    """
    schema = payload.get("schema")
    check_supported(schema, os.fspath(directory))
    directory = Path(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    if created:
        fsync_dir(directory.parent)
    index_path = directory / INDEX_NAME
    if index_path.exists():
        index_path.unlink()
        fsync_dir(directory)
    remove_stale_temps(directory)

    model = payload["model"]
    sizes = {k: v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
             for k, v in model.items()}
    plan = plan_shards(list(model.keys()), num_shards, group_by, sizes=sizes)
    meta = {k: v for k, v in payload.items() if k != "model"}
    jobs: list[tuple[str, str, Any, list[str] | None]] = [
        (name, "shard", {k: model[k] for k in keys}, keys) for name, keys in plan.items()]
    jobs.append((META_NAME, "meta", meta, None))
    workers = max_workers or min(len(jobs), os.cpu_count() or 1)

    def write_one(job):
        name, role, obj, keys = job
        size, digest = atomic_write(directory / name, lambda sink: torch.save(obj, sink), sync_dir=False)
        entry = {"name": name, "role": role, "bytes": size, "sha256": digest}
        if keys is not None:
            entry["keys"] = list(keys)
        return entry

    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            entries = list(pool.map(write_one, jobs))
    else:
        entries = [write_one(job) for job in jobs]
    fsync_dir(directory)  # the shards' renames are durable before the commit point exists
    counters = payload.get("counters") or {}
    index = build_index(schema=schema, global_step=int(counters.get("global_step", 0)),
                        wall_saved_at=payload.get("wall_saved_at"), files=entries)
    index["key_order"] = list(model.keys())
    extra = payload.get("extra") or {}
    if isinstance(extra.get("metric"), (int, float)):
        index["metric"] = float(extra["metric"])
    if record is not None:
        index["meta"] = record
    atomic_write_bytes(index_path, encode_index(index))
    return index


PARALLEL_MIN_BYTES = 4 << 20


def _default_workers(entries: list[dict[str, Any]]) -> int:
    """One thread per file for real checkpoints; none for small ones, where starting threads
    costs more than hashing and reading a few hundred kilobytes."""
    if sum(int(e.get("bytes", 0)) for e in entries) < PARALLEL_MIN_BYTES:
        return 1
    return min(len(entries), os.cpu_count() or 1)


def check_sizes(directory: str | os.PathLike) -> dict[str, Any]:
    """Cheap completeness check: the index is valid and every file exists with its size."""
    directory = Path(directory)
    index = read_index(directory)
    for entry in index["files"]:  # cheap checks first: fail early on a missing or cut file
        path = directory / entry["name"]
        try:
            st = os.stat(path)
        except FileNotFoundError as exc:
            raise IncompleteCheckpointError(path, "listed in index.json but missing") from exc
        except OSError as exc:
            raise CorruptCheckpointError(path, f"cannot stat: {exc}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(path, "listed in index.json but not a regular file")
        if st.st_size != entry["bytes"]:
            raise CorruptCheckpointError(path, f"size {st.st_size} bytes, index.json says {entry['bytes']}")
    return index


def verify_sharded(directory: str | os.PathLike, *, max_workers: int | None = None) -> dict[str, Any]:
    """Check the index, every file's size, then every file's sha256. Returns the index."""
    directory = Path(directory)
    index = check_sizes(directory)

    def hash_one(entry):
        path = directory / entry["name"]
        try:
            _, digest = sha256_file(path)
        except FileNotFoundError as exc:
            raise IncompleteCheckpointError(path, "listed in index.json but missing") from exc
        except OSError as exc:
            raise CorruptCheckpointError(path, f"cannot read: {exc}") from exc
        if digest != entry["sha256"]:
            raise CorruptCheckpointError(path, f"sha256 mismatch: index.json says {entry['sha256']}, "
                                               f"file has {digest}")

    workers = max_workers or _default_workers(index["files"])
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(hash_one, index["files"]))
    else:
        for entry in index["files"]:
            hash_one(entry)
    return index


def _read_verified(directory: Path, index: dict[str, Any], *, max_workers: int | None = None,
                   ) -> dict[str, torch.Tensor]:
    """Name -> the file's bytes, for every file of the index, each read once (hashed while being
    read) and checked against its size and sha256. Raises before returning anything."""
    def read_one(entry):
        path = directory / entry["name"]
        try:
            buffer, digest = read_hashed(path, entry["bytes"])
        except FileNotFoundError as exc:
            raise IncompleteCheckpointError(path, "listed in index.json but missing") from exc
        except SizeChanged as exc:
            raise CorruptCheckpointError(path, f"size {exc.actual} bytes, index.json says {entry['bytes']}") from exc
        except OSError as exc:
            raise CorruptCheckpointError(path, f"cannot read: {exc}") from exc
        if digest != entry["sha256"]:
            raise CorruptCheckpointError(path, f"sha256 mismatch: index.json says {entry['sha256']}, "
                                               f"file has {digest}")
        return entry["name"], buffer

    files = sorted(index["files"], key=lambda e: -e["bytes"])  # largest first: balanced threads
    workers = max_workers or _default_workers(files)
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return dict(pool.map(read_one, files))
    return dict(read_one(entry) for entry in files)


def load_sharded(directory: str | os.PathLike, map_location=None, *, verify: bool = True,
                 migrate_schema: bool = True, max_workers: int | None = None) -> dict[str, Any]:
    """Verify (unless told not to), load every file with weights_only=True, merge, migrate.

    With `verify`, every file is read once into memory, hashing as it is read, and every size and
    sha256 is checked before anything is deserialized; the tensors then share that memory."""
    directory = Path(directory)
    buffers: dict[str, torch.Tensor] = {}
    if verify:
        index = check_sizes(directory)
        buffers = _read_verified(directory, index, max_workers=max_workers)
    else:
        index = read_index(directory)
    meta_entry = next(e for e in index["files"] if e["role"] == "meta")
    shards = [e for e in index["files"] if e["role"] == "shard"]

    def load_one(entry):
        return entry, safe_torch_load(directory / entry["name"], map_location=map_location,
                                      buffer=buffers.pop(entry["name"], None))

    workers = max_workers or _default_workers(index["files"])
    with (ThreadPoolExecutor(max_workers=workers) if workers > 1 else contextlib.nullcontext()) as pool:
        loaded = list(pool.map(load_one, shards)) if pool else [load_one(e) for e in shards]
    merged: dict[str, Any] = {}
    for entry, part in loaded:
        path = directory / entry["name"]
        if not isinstance(part, dict) or sorted(part) != sorted(entry["keys"]):
            raise CorruptCheckpointError(path, "shard's parameter names disagree with index.json")
        merged.update(part)
    order = index.get("key_order")
    if isinstance(order, list) and sorted(order) == sorted(merged):
        model = {k: merged[k] for k in order}
    else:
        model = merged
    meta_path = directory / meta_entry["name"]
    meta = safe_torch_load(meta_path, map_location=map_location, buffer=buffers.pop(meta_entry["name"], None))
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(meta_path, f"expected a dict, found {type(meta).__name__}")
    if meta.get("schema") != index["schema"]:
        raise CorruptCheckpointError(meta_path, f"schema {meta.get('schema')!r} disagrees with "
                                                f"index.json's {index['schema']!r}")
    payload = dict(meta)
    payload["model"] = model
    return migrate(payload, os.fspath(directory)) if migrate_schema else payload


class ShardedLayout(LayoutBase):
    """The sharded layout (kinds.Layout): `step-N/` holding the shards, meta.pt and index.json,
    the commit point; what it records about itself is in the index."""

    meta_in_payload = False
    name, is_directory = "sharded", True

    def __init__(self, *, num_shards: int = 2, group_by: GroupBy | str | None = None, max_workers: int | None = None):
        self.num_shards, self.group_by, self.max_workers = num_shards, group_by, max_workers

    def save(self, payload: dict[str, Any], path: Path, *, step: int, metric: float | None,
             meta: dict[str, Any]) -> None:
        save_sharded(payload, path, num_shards=self.num_shards, group_by=self.group_by,
                     max_workers=self.max_workers, record=meta)

    def open(self, path: Path, map_location=None, *, continue_in=None) -> dict[str, Any]:
        return load_sharded(path, map_location)

    def verify(self, path: Path) -> None:
        verify_sharded(path)

    def check_committed(self, path: Path) -> dict[str, Any]:
        return check_sizes(path)

    def record(self, path: Path, index: dict[str, Any] | None = None) -> dict[str, Any]:
        return index if index is not None else read_index(path)

    def remove(self, path: Path) -> None:
        index = path / INDEX_NAME
        if index.exists():
            index.unlink()
            fsync_dir(path)
        shutil.rmtree(path, ignore_errors=True)

