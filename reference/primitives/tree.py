"""A payload as a tree of dicts, lists and tuples: walk it, split its tensors from the rest (the
skeleton, which a chained checkpoint keeps in its manifest), join them again, copy them."""
from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptCheckpointError

TENSOR_MARK = "\x00tensor:"      # a skeleton's placeholder for tensor i: TENSOR_MARK + str(i)


def _key(path: tuple) -> str:
    return "/".join(f"#{p}" if isinstance(p, int) else str(p) for p in path)


def map_tree(obj: Any, leaf, path: tuple = ()) -> Any:
    """`obj` rebuilt with every leaf replaced by leaf(value, path): dicts (an OrderedDict stays
    one), lists and tuples are walked; anything else is a leaf."""
    if isinstance(obj, dict):
        items = ((k, map_tree(v, leaf, (*path, k))) for k, v in obj.items())
        return collections.OrderedDict(items) if isinstance(obj, collections.OrderedDict) else dict(items)
    if type(obj) in (list, tuple):
        return type(obj)(map_tree(v, leaf, (*path, i)) for i, v in enumerate(obj))
    return leaf(obj, path)


def split_tensors(payload: Any) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """The payload with every tensor replaced by a marker, and the (key, tensor) list in order."""
    tensors: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()

    def leaf(obj: Any, path: tuple) -> Any:
        if not isinstance(obj, torch.Tensor):
            return obj
        key = _key(path)
        if key in seen:
            key = f"{key}@{len(tensors)}"
        seen.add(key)
        tensors.append((key, obj))
        return f"{TENSOR_MARK}{len(tensors) - 1}"
    return map_tree(payload, leaf), tensors


def join_tensors(skeleton: Any, tensors: list[torch.Tensor], path: Path) -> Any:
    def leaf(obj: Any, _path: tuple) -> Any:
        if not (isinstance(obj, str) and obj.startswith(TENSOR_MARK)):
            return obj
        i = int(obj[len(TENSOR_MARK):])
        if not 0 <= i < len(tensors):
            raise CorruptCheckpointError(path, f"skeleton refers to tensor {i}, the manifest lists {len(tensors)}")
        return tensors[i]
    return map_tree(skeleton, leaf)


def cpu_copy(payload: Any) -> Any:
    """The payload with every tensor copied to fresh CPU memory (what an async save persists)."""
    return map_tree(payload, lambda obj, _: obj.detach().to("cpu", copy=True) if isinstance(obj, torch.Tensor) else obj)
