"""The benchmark's workload: a model-like fp32 state, and the baseline (raw) ways to write and read it."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from .constants import _READ_CHUNK

# -- the state -------------------------------------------------------------------------------

def build_state(size_mb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformer-like fp32 state dict of about `size_mb` MiB: one large embedding, per layer
    four weight matrices plus biases and layer norms, and a head that tops the total up."""
    target = int(size_mb * (1 << 20))
    d = 128 if target < (16 << 20) else 512 if target < (1 << 30) else 1024
    g = torch.Generator().manual_seed(seed)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    total = 0

    def add(name: str, *shape: int) -> None:
        nonlocal total
        shapes.append((name, shape))
        n = 1
        for s in shape:
            n *= s
        total += 4 * n

    add("embed.weight", max(1, int(target * 0.2) // (4 * d)), d)
    layer = [("ln1.weight", (d,)), ("ln1.bias", (d,)), ("attn.qkv.weight", (3 * d, d)),
             ("attn.qkv.bias", (3 * d,)), ("attn.out.weight", (d, d)), ("attn.out.bias", (d,)),
             ("ln2.weight", (d,)), ("ln2.bias", (d,)), ("mlp.up.weight", (4 * d, d)),
             ("mlp.up.bias", (4 * d,)), ("mlp.down.weight", (d, 4 * d)), ("mlp.down.bias", (d,))]
    layer_bytes = 4 * (12 * d * d + 13 * d)
    i = 0
    while total + layer_bytes + 4 * 2 * d <= target:
        for name, shape in layer:
            add(f"layers.{i}.{name}", *shape)
        i += 1
    add("ln_f.weight", d)
    add("ln_f.bias", d)
    rows = max(1, (target - total) // (4 * d))
    add("head.weight", rows, d)
    state = {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.float32)
        t.normal_(generator=g)  # in place: building never needs more than the state itself
        state[name] = t
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _tensor_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()).cast("B")


# -- the variants ----------------------------------------------------------------------------

def raw_write(state: dict[str, torch.Tensor], path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        for t in state.values():
            view = _tensor_view(t)
            while view.nbytes:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(payload: dict[str, Any], path: Path) -> None:
    torch.save(payload, path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_scan(path: Path) -> tuple[None, str]:
    """For reference only: sha256 of the raw file read through one reused 8 MiB buffer, which
    builds no tensors (so pays no page faults for fresh memory)."""
    h = hashlib.sha256()
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return None, h.hexdigest()


def raw_read(like: dict[str, torch.Tensor], path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Read the raw file into freshly allocated tensors shaped like `like`, hashing every byte."""
    h = hashlib.sha256()
    out = {}
    with open(path, "rb", buffering=0) as f:
        for name, t in like.items():
            dst = torch.empty_like(t)
            view = _tensor_view(dst)
            pos = 0
            while pos < view.nbytes:
                n = f.readinto(view[pos:pos + _READ_CHUNK])
                if not n:
                    raise EOFError(f"{path}: short read")
                h.update(view[pos:pos + n])
                pos += n
            out[name] = dst
    return out, h.hexdigest()


# -- environment -----------------------------------------------------------------------------
