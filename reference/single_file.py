"""Single-file checkpoints: one torch.save zip, written atomically, with a digest of its contents.

The digest covers structure, scalars and tensor bytes (computed in memory before the write), so a
flipped bit anywhere in the state is caught on load even though torch.load itself would not notice.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .atomic import atomic_write
from .errors import CorruptCheckpointError, SchemaError
from .integrity import DIGEST_ALGORITHM, tree_digest
from .loading import safe_torch_load
from .schema import check_supported, migrate

INTEGRITY_KEY = "integrity"


def save_file(payload: dict[str, Any], path: str | os.PathLike) -> tuple[int, str]:
    """Atomically write `payload` to `path`. Returns (bytes, sha256 of the file)."""
    if INTEGRITY_KEY in payload:
        raise ValueError(f"payload must not carry a {INTEGRITY_KEY!r} key; it is added on save")
    check_supported(payload.get("schema"), os.fspath(path))
    stored = dict(payload)
    stored[INTEGRITY_KEY] = {"algorithm": DIGEST_ALGORITHM, "digest": tree_digest(payload)}
    return atomic_write(path, lambda sink: torch.save(stored, sink))


def load_file(path: str | os.PathLike, map_location=None, *, verify: bool = True,
              migrate_schema: bool = True) -> dict[str, Any]:
    """Load a single-file checkpoint with weights_only=True, verify its digest, migrate it."""
    path = os.fspath(path)
    payload = safe_torch_load(path, map_location=map_location)
    if not isinstance(payload, dict):
        raise CorruptCheckpointError(path, f"expected a dict payload, found {type(payload).__name__}")
    if "schema" not in payload:
        raise SchemaError(path, "payload has no 'schema' field")
    version = check_supported(payload["schema"], path)
    integrity = payload.pop(INTEGRITY_KEY, None)
    if version >= 2:
        if not isinstance(integrity, dict) or integrity.get("algorithm") != DIGEST_ALGORITHM:
            raise CorruptCheckpointError(path, f"missing or unknown integrity record {integrity!r}")
        if verify:
            actual = tree_digest(payload)
            if actual != integrity.get("digest"):
                raise CorruptCheckpointError(
                    path, f"content digest mismatch: stored {integrity.get('digest')}, computed "
                          f"{actual}; the file was modified or corrupted after it was written")
    return migrate(payload, path) if migrate_schema else payload
