"""The cold tier: committed checkpoints copied to object storage (any fsspec URL), verified, and
committed there by a marker written last.

Demotion of a checkpoint: upload every file it is made of (a chained checkpoint's pieces once:
pieces are named by their hash and shared), read each one back and compare size and sha256, then
write `<name>.cold.json` listing them. Only a checkpoint with a marker exists in the cold tier;
a half-uploaded one has none and is never listed, loaded or counted. The hot copy may be deleted
only after its marker is written (the manager decides when). Fetching copies a cold checkpoint
(and the chain it needs) back into the hot directory, each file checked against the marker and
renamed into place, so the ordinary loader verifies and loads it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from .. import names
from ..chain import read as chain
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, InvalidIndexError
from ..layouts.index import INDEX_NAME, read_index
from ..primitives.atomic import fsync_dir, temp_name_for
from ..primitives.integrity import sha256_file
from .fs import ColdStorageError, check_reachable, open_cold

MARKER_SUFFIX = ".cold.json"
MARKER_FORMAT = "reference.cold/1"
_CHUNK = 8 << 20
# Stores whose put is atomic (an object appears whole or not at all); elsewhere a file is
# written under a temporary name and moved into place.
_ATOMIC_PUT = {"s3", "s3a", "gs", "gcs", "az", "abfs", "memory"}


@dataclasses.dataclass(frozen=True)
class ColdFile:
    path: str          # relative to the branch directory, '/'-separated
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class ColdCheckpoint:
    """A checkpoint committed in the cold tier (its marker read and checked)."""

    name: str
    step: int
    files: tuple[ColdFile, ...]
    needs: tuple[str, ...]     # checkpoints (names) this one needs, its own name first
    meta: dict[str, Any]       # lineage, metric, best: for `log` and retention without a download
    marker: str                # the marker's key


class ColdTierError(CorruptCheckpointError):
    """A cold copy disagrees with the hot one or with its marker (size, sha256, missing object)."""




def checkpoint_files(path: Path) -> list[str]:
    """The files a committed hot checkpoint is made of, relative to its directory, in upload
    order (a sharded checkpoint's index last)."""
    if path.is_dir():
        index = read_index(path)
        return [f"{path.name}/{e['name']}" for e in index["files"]] + [f"{path.name}/{INDEX_NAME}"]
    if path.name.endswith(chain.SUFFIX):
        manifest, _ = chain.read_manifest(path)
        return [f"{chain.PIECES}/{p}" for p in sorted(chain.references(manifest))] + [path.name]
    return [path.name]


def _marker_checksum(body: dict[str, Any]) -> str:
    rest = {k: v for k, v in body.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def marker_bytes(name: str, step: int, needs: list[str], meta: dict[str, Any], files: list[ColdFile]) -> bytes:
    """The cold commit marker of checkpoint `name`: the files it is made of, their sizes and hashes."""
    body = {"format": MARKER_FORMAT, "name": name, "step": step, "needs": list(needs), "meta": meta,
            "files": [dataclasses.asdict(f) for f in files], "uploaded_at": time.time()}
    body["sha256"] = _marker_checksum(body)
    return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"


class ColdTier:
    """One cold location (`url`), mirroring the run directory's layout below it."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, storage_options: dict[str, Any] | None = None):
        self.url = url
        self.fs, self.root = open_cold(url, timeout_s=timeout_s, storage_options=storage_options)
        check_reachable(self.fs, self.root, url, timeout_s=timeout_s)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.atomic_put = bool(set(protocols) & _ATOMIC_PUT)

    def key(self, branch_rel: str, rel: str = "") -> str:
        parts = [self.root.rstrip("/")] + [p for p in (branch_rel, rel) if p]
        return "/".join(parts)

    def where(self, branch_rel: str, rel: str = "") -> str:
        """The URL of an object, for messages."""
        return self.url.rstrip("/") + "/" + "/".join(p for p in (branch_rel, rel) if p)

    def _call(self, what: str, target: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except (OSError, ValueError, RuntimeError) as exc:   # botocore and aiohttp errors surface as these
            raise ColdStorageError(target, f"{what} failed: {type(exc).__name__}: {exc}") from exc

    # -- listing ----------------------------------------------------------------------------
    def list(self, branch_rel: str = "") -> list[ColdCheckpoint]:
        """Checkpoints committed in the cold tier under `branch_rel`, oldest first. A marker that
        does not parse or check is skipped (its checkpoint is not committed)."""
        base = self.key(branch_rel)
        self.fs.invalidate_cache()
        try:
            names = self._call("listing", self.where(branch_rel), self.fs.ls, base, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for full in names:
            name = full.rstrip("/").rsplit("/", 1)[-1]
            if not name.endswith(MARKER_SUFFIX):
                continue
            try:
                found.append(self.read_marker(branch_rel, name))
            except (InvalidIndexError, FileNotFoundError):
                continue
        return sorted(found, key=lambda c: (c.step, c.name))

    def read_marker(self, branch_rel: str, marker_name: str) -> ColdCheckpoint:
        where = self.where(branch_rel, marker_name)
        raw = self._call("reading", where, self.fs.cat_file, self.key(branch_rel, marker_name))
        name = marker_name[:-len(MARKER_SUFFIX)]
        try:
            body = json.loads(raw)
            if not (isinstance(body, dict) and body.get("format") == MARKER_FORMAT
                    and body.get("sha256") == _marker_checksum(body) and isinstance(body.get("step"), int)
                    and isinstance(body.get("files"), list) and body.get("name") == name):
                raise ValueError("format, checksum, step or name")
            files = tuple(ColdFile(str(f["path"]), int(f["bytes"]), str(f["sha256"])) for f in body["files"])
            if any(f.path.startswith("/") or ".." in f.path.split("/") for f in files):
                raise ValueError("a file path outside the checkpoint directory")
            needs = tuple(str(n) for n in (body.get("needs") or (name,)))
            meta = dict(body.get("meta") or {})
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidIndexError(where, f"not a valid cold commit marker: {exc}") from None
        return ColdCheckpoint(name, body["step"], files, needs, meta, self.key(branch_rel, marker_name))

    # -- upload -----------------------------------------------------------------------------
    def _put(self, local: Path, key: str, where: str) -> None:
        if self.atomic_put:
            self._call("upload", where, self.fs.put_file, os.fspath(local), key)
            return
        tmp = f"{key}.tmp-{uuid.uuid4().hex[:16]}"
        self._call("upload", where, self.fs.put_file, os.fspath(local), tmp)
        self._call("rename", where, self.fs.mv, tmp, key)

    def put_bytes(self, key: str, data: bytes, where: str) -> None:
        """Write a small object whole: in place on a store whose put is atomic, else under a temp
        name moved into place."""
        if self.atomic_put:
            self._call("writing", where, self.fs.pipe_file, key, data)
            return
        tmp = f"{key}.tmp-{uuid.uuid4().hex[:16]}"
        self._call("writing", where, self.fs.pipe_file, tmp, data)
        self._call("rename", where, self.fs.mv, tmp, key)

    def _stream(self, key: str, where: str, sink=None) -> tuple[int, str]:
        """Read an object through (to `sink`, if given): its size and sha256. A missing object is
        FileNotFoundError; any other failure of the store a ColdStorageError naming it."""
        h, n = hashlib.sha256(), 0
        try:
            with self.fs.open(key, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    n += len(chunk)
                    if sink is not None:
                        sink.write(chunk)
        except FileNotFoundError:
            raise
        except Exception as exc:     # botocore, aiohttp and OS errors alike
            raise ColdStorageError(where, f"reading failed: {type(exc).__name__}: {exc}") from exc
        return n, h.hexdigest()

    def upload(self, hot_dir: Path, branch_rel: str, path: Path, *, needs: list[str], meta: dict[str, Any],
               verified: dict[str, ColdFile]) -> ColdCheckpoint:
        """Copy the committed hot checkpoint `path`, verify the copy, then write its marker.
        `verified` holds files some cold marker already lists (a chain's shared pieces): they
        are not uploaded again if the store has them at that size."""
        step = names.step_of(path.name)
        files: list[ColdFile] = []
        for rel in checkpoint_files(path):
            local = hot_dir / rel
            known = verified.get(rel)
            key, where = self.key(branch_rel, rel), self.where(branch_rel, rel)
            if known is not None and self._size(key) == known.bytes:
                files.append(known)
                continue
            size, digest = sha256_file(local)
            self._put(local, key, where)
            got = self._stream(key, where)
            if got != (size, digest):
                raise ColdTierError(where, f"the uploaded copy has {got[0]} bytes, sha256 {got[1][:16]}...; the hot "
                                           f"file {local} has {size} bytes, sha256 {digest[:16]}...")
            files.append(ColdFile(rel, size, digest))
        marker = path.name + MARKER_SUFFIX
        key = self.key(branch_rel, marker)
        self.put_bytes(key, marker_bytes(path.name, step, needs, meta, files), self.where(branch_rel, marker))
        # The marker is read back too: a hot copy is only ever deleted for a marker the store returns.
        try:
            back = self.read_marker(branch_rel, marker)
        except (InvalidIndexError, FileNotFoundError) as exc:
            raise ColdTierError(self.where(branch_rel, marker), f"the marker does not read back: {exc}") from None
        if back.files != tuple(files):
            raise ColdTierError(self.where(branch_rel, marker), "the marker reads back with other files")
        return back

    def _size(self, key: str) -> int | None:
        try:
            return int(self.fs.info(key)["size"])
        except (FileNotFoundError, KeyError, OSError):
            return None

    # -- fetch and delete -------------------------------------------------------------------
    def fetch(self, cold: ColdCheckpoint, hot_dir: Path, branch_rel: str) -> Path:
        """Copy one cold checkpoint's files into `hot_dir`: each downloaded to a temp name, checked
        against the marker, fsynced, then renamed into place (a sharded checkpoint's index last);
        returns the checkpoint's hot path. A file missing from the store is an
        IncompleteCheckpointError, a mismatch a ColdTierError (the checkpoint is skipped); a store
        that fails is a ColdStorageError (raised: the caller may retry; an older checkpoint is
        not silently taken instead)."""
        for f in cold.files:
            target = hot_dir / f.path
            if target.is_file() and target.stat().st_size == f.bytes and sha256_file(target)[1] == f.sha256:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            where = self.where(branch_rel, f.path)
            tmp = temp_name_for(target)
            try:
                with open(tmp, "wb") as sink:
                    try:
                        got = self._stream(self.key(branch_rel, f.path), where, sink)
                    except FileNotFoundError:
                        raise IncompleteCheckpointError(where, "listed by its cold commit marker but missing") from None
                    if got != (f.bytes, f.sha256):
                        raise ColdTierError(where, f"downloaded {got[0]} bytes, sha256 {got[1][:16]}...; its marker "
                                                   f"says {f.bytes} bytes, {f.sha256[:16]}...")
                    sink.flush()
                    os.fsync(sink.fileno())
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(target.parent)
        return hot_dir / cold.name

    def delete(self, cold: ColdCheckpoint, branch_rel: str, *, shared: set[str]) -> None:
        """Remove a cold checkpoint: its marker first (it is then no longer committed), then
        its files, except those in `shared` (pieces another cold checkpoint lists)."""
        self._call("delete", self.where(branch_rel, cold.name + MARKER_SUFFIX), self.fs.rm_file, cold.marker)
        for f in cold.files:
            if f.path in shared:
                continue
            try:
                self.fs.rm_file(self.key(branch_rel, f.path))
            except FileNotFoundError:
                pass
        if any(f.path.startswith(cold.name + "/") for f in cold.files):   # a sharded checkpoint's folder
            try:
                self.fs.rm(self.key(branch_rel, cold.name), recursive=True)
            except (FileNotFoundError, OSError):
                pass
