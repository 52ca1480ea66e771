"""Single-file checkpoints: one torch.save zip, written atomically, with a digest of its contents.

The digest covers structure, scalars and tensor bytes (computed in memory before the write), so a
flipped bit anywhere in the state is caught on load even though torch.load itself would not notice.

Since schema 2 the file also carries a whole-file sha256 in the zip archive's comment (the last
bytes of the file): sha256 over every byte before the comment-length field. torch.load ignores zip
metadata, padding, CRC fields and the serialization id, so without it a flipped bit in roughly half
of a small file's bytes would load silently; with it, any flipped bit or cut is refused before
anything is unpickled.
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, SchemaError
from ..primitives.atomic import atomic_write
from ..primitives.integrity import DIGEST_ALGORITHM, tree_digest
from ..primitives.loading import safe_torch_load
from ..primitives.schema import check_supported, migrate
from .base import LayoutBase

INTEGRITY_KEY = "integrity"

# Zip end-of-central-directory record: signature, ..., comment length (last 2 bytes), comment.
_EOCD_SIG = b"PK\x05\x06"
_EOCD_LEN = 22
FILE_CHECKSUM_MAGIC = b"reference-checkpoint-sha256:"
_COMMENT_LEN = len(FILE_CHECKSUM_MAGIC) + 64
_CHUNK = 8 << 20


class _HoldBackCommentLength:
    """Forwards torch.save's bytes to the sink, holding back the final two: the zip comment
    length (0 as torch writes it), which save_file replaces once the rest is hashed."""

    def __init__(self, sink):
        self._sink = sink
        self._tail = b""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n >= 2:
            if self._tail:
                self._sink.write(self._tail)
            if n > 2:
                self._sink.write(view[:-2])
            self._tail = bytes(view[-2:])
        else:
            combined = self._tail + bytes(view)
            if len(combined) > 2:
                self._sink.write(combined[:-2])
            self._tail = combined[-2:]
        return n

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        if self._tail != b"\x00\x00":
            raise RuntimeError(f"torch.save did not end with an empty zip comment ({self._tail!r})")


def _write_with_checksum(stored: dict[str, Any], sink) -> None:
    inner = _HoldBackCommentLength(sink)
    torch.save(stored, inner)
    inner.finish()
    sink.flush()  # everything but the comment length is written, so hashed
    digest = sink.hexdigest()
    sink.write(struct.pack("<H", _COMMENT_LEN) + FILE_CHECKSUM_MAGIC + digest.encode("ascii"))


def file_checksum(path: str | os.PathLike) -> tuple[str, str] | None:
    """(stored, computed) whole-file sha256 of a single-file checkpoint, or None if the file
    carries no checksum comment (schema 1, or the comment itself was damaged)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        tail_len = _EOCD_LEN + _COMMENT_LEN
        if size < tail_len:
            return None
        f.seek(size - tail_len)
        tail = f.read(tail_len)
        if (len(tail) != tail_len or tail[:4] != _EOCD_SIG
                or tail[_EOCD_LEN - 2:_EOCD_LEN] != struct.pack("<H", _COMMENT_LEN)
                or not tail[_EOCD_LEN:].startswith(FILE_CHECKSUM_MAGIC)):
            return None
        stored = tail[_EOCD_LEN + len(FILE_CHECKSUM_MAGIC):].decode("ascii", errors="replace")
        remaining = size - _COMMENT_LEN - 2
        h = hashlib.sha256()
        f.seek(0)
        while remaining:
            chunk = f.read(min(_CHUNK, remaining))
            if not chunk:
                break
            h.update(chunk)
            remaining -= len(chunk)
        return stored, h.hexdigest()


def _verify_file_checksum(path: str) -> bool:
    """True if the file carries a whole-file checksum and it matches; False if it carries none."""
    try:
        result = file_checksum(path)
    except FileNotFoundError as exc:
        raise IncompleteCheckpointError(path, "file is missing") from exc
    except OSError as exc:
        raise CorruptCheckpointError(path, f"cannot read: {exc}") from exc
    if result is None:
        return False
    stored, actual = result
    if stored != actual:
        raise CorruptCheckpointError(path, f"whole-file sha256 mismatch: stored {stored!r}, computed "
                                           f"{actual}; the file was modified or corrupted after it "
                                           "was written")
    return True


def save_file(payload: dict[str, Any], path: str | os.PathLike) -> tuple[int, str]:
    """Atomically write `payload` to `path`. Returns (bytes, sha256 of the file)."""
    if INTEGRITY_KEY in payload:
        raise ValueError(f"payload must not carry a {INTEGRITY_KEY!r} key; it is added on save")
    check_supported(payload.get("schema"), os.fspath(path))
    # The whole-file sha256 (hashed while writing, checked before unpickling) covers every byte,
    # so no separate in-memory digest of the contents is computed: that was a second full pass.
    return atomic_write(path, lambda sink: _write_with_checksum(payload, sink))   # CheckpointWriteError


def load_file(path: str | os.PathLike, map_location=None, *, verify: bool = True,
              migrate_schema: bool = True) -> dict[str, Any]:
    """Load a single-file checkpoint with weights_only=True, verify its digest, migrate it."""
    path = os.fspath(path)
    has_file_checksum = _verify_file_checksum(path) if verify else None
    payload = safe_torch_load(path, map_location=map_location)
    if not isinstance(payload, dict):
        raise CorruptCheckpointError(path, f"expected a dict payload, found {type(payload).__name__}")
    if "schema" not in payload:
        raise SchemaError(path, "payload has no 'schema' field")
    version = check_supported(payload["schema"], path)
    integrity = payload.pop(INTEGRITY_KEY, None)
    if version >= 2:
        if verify and not has_file_checksum:
            raise CorruptCheckpointError(path, "no whole-file checksum in the zip comment (every "
                                               f"{payload['schema']} file carries one): damaged or "
                                               "not written by this library")
        if integrity is not None and (not isinstance(integrity, dict)
                                      or integrity.get("algorithm") != DIGEST_ALGORITHM):
            raise CorruptCheckpointError(path, f"unknown integrity record {integrity!r}")
        if verify and integrity is not None:  # files written before the digest was dropped
            actual = tree_digest(payload)
            if actual != integrity.get("digest"):
                raise CorruptCheckpointError(
                    path, f"content digest mismatch: stored {integrity.get('digest')}, computed "
                          f"{actual}; the file was modified or corrupted after it was written")
    return migrate(payload, path) if migrate_schema else payload


class FileLayout(LayoutBase):
    """The single-file layout (kinds.Layout): `step-N.pt`; what it records about itself travels
    inside the payload (`extra["meta"]`), there being no index to hold it."""

    meta_in_payload = True
    name, is_directory = "file", False
    _records: dict[tuple[str, int, int], dict[str, Any]] = {}

    def save(self, payload: dict[str, Any], path: Path, *, step: int, metric: float | None,
             meta: dict[str, Any]) -> None:
        save_file({**payload, "extra": {**(payload.get("extra") or {}), "meta": meta}}, path)

    def open(self, path: Path, map_location=None, *, continue_in=None) -> dict[str, Any]:
        return load_file(path, map_location)

    def verify(self, path: Path) -> None:
        load_file(path, map_location="cpu")

    def check_committed(self, path: Path) -> None:
        if not path.is_file():
            raise CheckpointError(path, "not a regular file")

    def record(self, path: Path, index: dict[str, Any] | None = None) -> dict[str, Any]:
        # Loaded once per process: a committed file is never rewritten in place, so its size and
        # mtime name this version of it.
        try:
            st = os.stat(path)
        except OSError as exc:
            raise CheckpointError(path, f"cannot read: {exc}") from None
        key = (os.fspath(path), st.st_size, st.st_mtime_ns)
        if key not in self._records:
            if len(self._records) > 256:
                self._records.clear()
            self._records[key] = load_file(path, "cpu").get("extra") or {}
        return self._records[key]

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

