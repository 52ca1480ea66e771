"""A state as bytes in memory and back, for what is written or sent whole: `torch_bytes` (torch.save
into memory) and `from_torch_bytes` (read back with weights_only=True, through `loading`).

A multi-rank save writes its per-rank files with it, a node-local save sends its replica to the
peer node as it, and a chained checkpoint's skeleton is stored in its manifest as it.
"""
from __future__ import annotations

import io
import os
from typing import Any

import torch

from .loading import safe_torch_load


def torch_bytes(obj: Any) -> bytes:
    """`obj` torch.save'd into memory."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_torch_bytes(data: bytes, where: str | os.PathLike) -> Any:
    """`data` (torch_bytes' output, already verified) loaded onto the CPU with weights_only=True;
    `where` names it in a CheckpointError if it cannot be loaded."""
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return safe_torch_load(where, map_location="cpu", buffer=buffer)
