"""Hashing primitives: file hashes for shards, and a structural digest for single-file payloads.

torch.load happily returns flipped tensor bytes, so only a checksum catches a bit flip.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import torch

_CHUNK = 8 << 20
_PARALLEL_MIN_BYTES = 1 << 20
DIGEST_ALGORITHM = "sha256-tree/1"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's logical bytes (C order) as a flat byte view, copying only if non-contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def sha256_file(path: str | os.PathLike) -> tuple[int, str]:
    """(size, sha256) of a file, read in large chunks into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            total += n
    return total, h.hexdigest()


def _walk(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Deterministic pre-order walk; yields (path, leaf) and a marker for each container."""
    if isinstance(obj, dict):
        yield path, ("dict", len(obj))
        for k, v in obj.items():
            yield from _walk(v, f"{path}/{type(k).__name__}:{k}")
    elif isinstance(obj, (list, tuple)):
        yield path, (type(obj).__name__, len(obj))
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}/{i}")
    else:
        yield path, obj


def tree_digest(payload: Any, pool: ThreadPoolExecutor | None = None) -> str:
    """sha256 over structure, scalar values, and every tensor's dtype, shape and bytes.

    Large tensors are hashed in parallel threads (hashlib releases the GIL).
    """
    leaves = list(_walk(payload, ""))
    tensors = [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]
    big = [t for t in tensors if t.numel() * t.element_size() >= _PARALLEL_MIN_BYTES]
    own_pool = pool is None and len(big) > 1
    if own_pool:
        pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1))
    try:
        if pool is not None and big:
            big_digests = dict(zip(map(id, big), pool.map(
                lambda t: hashlib.sha256(tensor_bytes(t)).digest(), big)))
        else:
            big_digests = {}
    finally:
        if own_pool:
            pool.shutdown()
    h = hashlib.sha256()
    for path, leaf in leaves:
        h.update(path.encode())
        if isinstance(leaf, torch.Tensor):
            h.update(f"T{leaf.dtype}{tuple(leaf.shape)}".encode())
            digest = big_digests.get(id(leaf))
            h.update(digest if digest is not None else hashlib.sha256(tensor_bytes(leaf)).digest())
        else:
            h.update(f"{type(leaf).__name__}={leaf!r}".encode())
    return h.hexdigest()
