"""Hashing primitives: file hashes for shards, and a structural digest for single-file payloads.

torch.load happily returns flipped tensor bytes, so only a checksum catches a bit flip.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
    if t.numel() <= 1 and t.stride() != (1,):
        # A 0- or 1-element view (e.g. x[::2] of a 2-vector) counts as contiguous whatever its
        # stride, so contiguous() keeps the stride and view(uint8) below would refuse it.
        t = t.clone(memory_format=torch.contiguous_format)
        if t.stride() != (1,):
            t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def sha256_file(path: str | os.PathLike) -> tuple[int, str]:
    """(size, sha256) of a file, read in large chunks into one reused buffer."""
    h = hashlib.sha256()
    total = 0
    with open(path, "rb", buffering=0) as f:
        # A buffer no larger than the file: zeroing 8 MiB costs more than hashing a small file.
        buf = bytearray(max(1, min(_CHUNK, os.fstat(f.fileno()).st_size + 1)))
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            total += n
    return total, h.hexdigest()


class SizeChanged(Exception):
    """The file's size is not the expected one (checked on the open file, and again at EOF)."""

    def __init__(self, actual: int, expected: int):
        super().__init__(f"size {actual} bytes, expected {expected}")
        self.actual = actual
        self.expected = expected


def read_hashed(path: str | os.PathLike, expected_size: int) -> tuple[torch.Tensor, str]:
    """Read a whole file into one freshly allocated 1-D uint8 tensor, hashing each chunk as it
    arrives: one pass over the disk, and the bytes kept are exactly the bytes hashed (no second
    read that could see different bytes). Raises SizeChanged if the file is not
    `expected_size` bytes long."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size != expected_size:
            raise SizeChanged(size, expected_size)
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buffer = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buffer.numpy()).cast("B")
        h = hashlib.sha256()
        pos = 0
        while pos < size:
            n = os.readv(fd, [view[pos:pos + _CHUNK]])
            if n == 0:
                raise SizeChanged(pos, expected_size)
            h.update(view[pos:pos + n])
            pos += n
        if os.read(fd, 1):
            raise SizeChanged(os.fstat(fd).st_size, expected_size)
        return buffer, h.hexdigest()
    finally:
        os.close(fd)


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
    elif isinstance(obj, (set, frozenset)):
        # Iteration order of a set depends on insertion history and on string hash randomisation
        # (differs between the saving and the loading process): hash its members in sorted order.
        yield path, (type(obj).__name__, len(obj))
        for i, v in enumerate(sorted(obj, key=lambda x: (type(x).__name__, repr(x)))):
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
