"""Writing a chained checkpoint (chain.py reads, verifies and sweeps them): pieces first, each
atomic and fsynced, prepared on worker threads a bounded window ahead and written in the payload's
order by the calling thread (so a save's filesystem operations are the same in every run), then
the pieces directory fsynced, then the manifest, the commit point."""
from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..errors import write_error
from ..primitives.atomic import atomic_write, fsync_dir, remove_stale_temps
from ..primitives.encoding import torch_bytes
from ..primitives.integrity import tensor_bytes
from ..primitives.schema import check_supported
from ..primitives.tree import split_tensors
from . import codec
from .read import (
    CHECKSUM_KEY,
    FORMAT,
    Parent,
    changed_rows,
    manifest_checksum,
    manifest_name,
    parent_from,
    pieces_dir,
    tensor_sha256,
)

AHEAD_PIECES = 16         # pieces prepared ahead of the writes, per worker
AHEAD_BYTES = 256 << 20   # raw bytes of the pieces prepared ahead, past the first one per worker


@dataclasses.dataclass
class SaveResult:
    """A committed save: its manifest, what a later delta may be taken against, the bytes it wrote
    (new pieces and the manifest) and the raw bytes of the tensors it lists."""

    path: Path
    parent: Parent
    written_bytes: int
    listed_bytes: int


def save_chain(payload: dict[str, Any], directory: Path, step: int, *, kind: str, parent: Parent | None,
               since_full: int = 0, compression: codec.Compression | None = None,
               max_workers: int | None = None, metric: float | None = None,
               keep_rows: bool = True, meta: dict[str, Any] | None = None) -> SaveResult:
    """Write a checkpoint: pieces first (each atomic and fsynced), the pieces directory fsynced,
    then the manifest (the commit point). `kind` "full" (parent None) writes every piece; a delta
    writes what the store lacks and rows against `parent`. `keep_rows`: keep CPU copies of the
    tensors a later delta could take rows against (not needed when none will be taken)."""
    check_supported(payload.get("schema"), os.fspath(directory))
    if (kind == "full") != (parent is None):
        raise ValueError("a full checkpoint has no parent; a delta needs one")
    store = pieces_dir(directory)
    created = not store.is_dir()
    try:
        store.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_dir(directory)
        remove_stale_temps(store)
        # What earlier saves stored, listed once: a delta does not rewrite it. Not asked per piece
        # as the store fills, so what a worker finds does not depend on how far the writes got.
        stored_before = set(os.listdir(store)) if kind != "full" else set()
    except OSError as exc:
        raise write_error(store, exc) from exc
    skeleton, tensors = split_tensors(payload)
    written = [0]
    # Pieces are prepared (hashed, rows found, encoded) by `prepare`, possibly on worker threads,
    # and written by the calling thread in order: compression overlaps the writes and fsyncs.
    Write = tuple[Path, list, int]

    def piece(raw, digest: str, dtype: torch.dtype | None, writes: list[Write]) -> dict[str, Any]:
        target = store / digest
        if digest in stored_before:
            return {"piece": digest, "bytes": len(raw)}
        parts, header = codec.encode(raw, dtype=dtype, compression=compression)
        writes.append((target, parts, header["stored_bytes"]))
        return {"piece": digest, "bytes": len(raw), "stored": header["stored_bytes"], "codec": header["codec"]}

    def prepare(item: tuple[str, torch.Tensor]) -> tuple[dict[str, Any], list[Write]]:
        key, t = item
        t = t.detach().cpu()
        raw = tensor_bytes(t)
        digest = hashlib.sha256(raw).hexdigest()
        entry: dict[str, Any] = {"key": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                 "sha256": digest}
        writes: list[Write] = []
        old = parent.rows.get(key) if parent is not None else None
        if old is not None and old.shape == t.shape and old.dtype == t.dtype and t.numel():
            changed = changed_rows(old, t)
            row_bytes = t[0].numel() * t.element_size()
            if 0 < changed.numel() and changed.numel() * (row_bytes + 8) * 2 < len(raw):
                values = t[changed].contiguous()
                entry["rows"] = {"index": piece(tensor_bytes(changed), tensor_sha256(changed), torch.int64, writes),
                                 "values": piece(tensor_bytes(values), tensor_sha256(values), t.dtype, writes)}
                entry["bytes"] = len(raw)
                return entry, writes
        entry.update(piece(raw, digest, t.dtype, writes))
        return entry, writes

    in_this_save: set[str] = set()

    def write(writes: list[Write]) -> None:
        for target, parts, stored in writes:
            if target.name in in_this_save:
                # Equal tensors (tied, or zeros alike) in one payload: one piece, written where it
                # first appears, so the operations do not depend on which worker saw what first.
                continue
            in_this_save.add(target.name)
            # Named by the hash of its raw bytes, taken already: no second hash while writing.
            atomic_write(target, lambda sink: [sink.write(p) for p in parts], sync_dir=False, hashing=False)
            written[0] += len(parts[0]) + stored

    workers = max_workers or min(len(tensors), os.cpu_count() or 1) or 1
    entries: list[dict[str, Any]] = []
    try:
        if workers > 1 and len(tensors) > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                todo = collections.deque(tensors)
                window: collections.deque = collections.deque()   # (future, raw bytes), in write order

                def fill() -> None:
                    # Workers run ahead of the writes within a window: a large piece at the head
                    # does not leave the other workers idle, and the pieces waiting (encoded) stop
                    # at about AHEAD_BYTES (one piece per worker is always allowed).
                    while todo and len(window) < AHEAD_PIECES * workers and (
                            len(window) < workers or sum(size for _, size in window) < AHEAD_BYTES):
                        item = todo.popleft()
                        window.append((pool.submit(prepare, item), item[1].nbytes))
                fill()
                try:
                    while window:
                        entry, writes = window.popleft()[0].result()
                        fill()
                        write(writes)
                        entries.append(entry)
                finally:
                    for future, _ in window:
                        future.cancel()
        else:
            for item in tensors:
                entry, writes = prepare(item)
                write(writes)
                entries.append(entry)
        fsync_dir(store)   # every piece listed (written now or earlier) is durable before the commit
    except OSError as exc:
        raise write_error(directory / manifest_name(step), exc) from exc
    manifest: dict[str, Any] = {
        "format": FORMAT, "schema": payload["schema"], "step": int(step), "kind": kind,
        "parent": None if parent is None else {"name": parent.name, "sha256": parent.sha256},
        "since_full": 0 if parent is None else since_full, "base": manifest_name(step) if parent is None else parent.base,
        "tensors": entries, "skeleton": skeleton_text(skeleton),
        "piece_bytes_written": written[0], "wall_saved_at": payload.get("wall_saved_at"),
    }
    if metric is not None:
        manifest["metric"] = float(metric)
    if meta is not None:          # lineage and why it was saved, readable without loading
        manifest["meta"] = meta
    manifest[CHECKSUM_KEY] = manifest_checksum(manifest)
    body = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    path = directory / manifest_name(step)
    atomic_write(path, lambda sink: sink.write(body))   # the commit point (fsyncs the directory)
    listed = sum(e["bytes"] for e in entries)
    return SaveResult(path, parent_from(path, manifest, hashlib.sha256(body).hexdigest(), tensors if keep_rows else []),
                      written[0] + len(body), listed)


def skeleton_text(skeleton: Any) -> str:
    """The skeleton, torch.save'd and base64-encoded: small, and part of the manifest (a piece of
    its own would be named by a hash that changes with every save's wall-clock time)."""
    return base64.b64encode(torch_bytes(skeleton)).decode("ascii")


@dataclasses.dataclass
class ChainWriter:
    """A manager's chained saves: what the next one is (full, or a delta against the previous
    checkpoint or the last full one) and the state that decides it, set by each save and by a
    load (`follow`)."""

    directory: Path
    strategy: str = "full"              # full | incremental | differential
    full_every: int = 10
    compression: codec.Compression | None = None
    max_workers: int | None = None
    last: Parent | None = None          # the newest chained checkpoint saved or loaded here
    base: Parent | None = None          # the last full one (differential deltas are taken against it)
    last_save: SaveResult | None = None

    def next_kind(self) -> tuple[str, Parent | None]:
        """What the next chained save will be: full, or a delta and the checkpoint it is taken
        against (the previous one, or for differential the last full one)."""
        last = self.last
        if self.strategy == "full" or last is None or last.since_full + 1 >= self.full_every:
            return "full", None
        parent = last if self.strategy == "incremental" else self.base
        if parent is None or not (self.directory / parent.name).exists():
            return "full", None
        return self.strategy, parent

    def save(self, payload: dict[str, Any], step: int, metric: float | None = None,
             meta: dict[str, Any] | None = None) -> SaveResult:
        kind, parent = self.next_kind()
        result = save_chain(payload, self.directory, step, kind=kind, parent=parent,
                            since_full=0 if parent is None else self.last.since_full + 1,
                            compression=self.compression, max_workers=self.max_workers, metric=metric, meta=meta,
                            # Rows are taken against the previous checkpoint (incremental) or the
                            # last full one (differential); never for strategy "full".
                            keep_rows=self.strategy == "incremental"
                            or (self.strategy == "differential" and kind == "full"))
        self.last = result.parent
        if kind == "full":
            self.base = result.parent
        elif self.strategy == "incremental":
            self.base = None     # never a parent again; the chain's root stays on disk
        self.last_save = result
        return result

    def follow(self, directory: Path, last: Parent | None = None, base: Parent | None = None) -> None:
        """Continue in `directory` from a loaded chain (`last`, `base`), or with a full checkpoint
        next (none given: a new branch, or a checkpoint from elsewhere)."""
        self.directory, self.last, self.base = directory, last, base
