"""Digests of a trainer's state, logged beside each step's loss (the public name:
conformance.contract.state_digest).

    from conformance.contract import state_digest
    log.write(json.dumps({"step": step, "loss": loss,
                          "state": state_digest(model=model, optimizer=optimizer, scheduler=scheduler,
                                                rng=True, data=sampler.state_dict())}) + "\\n")

Each component maps to the SHA-256 of its exact bytes: every tensor's dtype, shape and raw bytes,
every number's exact value, in a fixed order. Two states digest equal only if they are bit for bit
the same, so a resume that restored everything gives the uninterrupted run's digests at every step,
and one that lost a component (an EMA never saved, a moment cast to fp16) names it. Components are
free-form: `model`, `optimizer`, `scheduler`, `rng` and `data` are the usual ones; add any other
(`ema=ema_model`). A trainer outside Python writes the same line with digests it computes itself
(docs/running.md, "State digests").
"""
from __future__ import annotations

import hashlib
import random
import struct
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["rng_state", "state_digest", "digest"]


def state_digest(**components: Any) -> dict[str, str]:
    """`{name: hex digest}` of each component given. A torch module, optimizer or LR scheduler is
    digested by its `state_dict()`; `rng=True` stands for every generator (rng_state()); anything
    else is digested as it is (tensors, arrays, numbers, strings, and dicts, lists and tuples of
    them). A component given as None is left out."""
    out = {}
    for name, value in components.items():
        if value is None or value is False:
            continue
        if name == "rng" and value is True:
            value = rng_state()
        out[name] = digest(value)
    return out


def digest(value: Any) -> str:
    """The hex SHA-256 of one component's exact bytes."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    """Every generator the suite expects a checkpoint to hold: Python's, NumPy's global one, torch's
    CPU generator and each CUDA device's (those initialized)."""
    state: dict[str, Any] = {"python": random.getstate()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    try:
        import torch
    except ImportError:
        return state
    state["torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _feed(h, value: Any) -> None:
    """Write a tagged, unambiguous encoding of `value` into the hash `h`. The common kinds of a
    state dict (tensors, dicts, numbers) are tried first: a digest runs after every step."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if hasattr(value, "to_local"):   # a DTensor (FSDP2): this rank's own shard is its state
            value = value.to_local()
        t = value.detach().cpu().contiguous()
        h.update(b"t%b:%b;" % (str(t.dtype).encode(), str(tuple(t.shape)).encode()))
        h.update(t.reshape(-1).view(torch.uint8).numpy())
        return
    if isinstance(value, Mapping):
        # Keys in a fixed order whatever the insertion order (optimizer state is keyed by ints).
        items = sorted(value.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        h.update(b"{" + struct.pack("<Q", len(items)))
        for k, v in items:
            _feed(h, k)
            _feed(h, v)
        h.update(b"}")
        return
    if value is None or isinstance(value, bool):
        h.update(b"N" if value is None else (b"T" if value else b"F"))
        return
    if isinstance(value, int):
        h.update(b"i%d;" % value)
        return
    if isinstance(value, float):
        h.update(b"f" + struct.pack("<d", value))
        return
    if isinstance(value, (str, bytes, bytearray)):
        raw = value.encode() if isinstance(value, str) else bytes(value)
        h.update((b"s" if isinstance(value, str) else b"b") + struct.pack("<Q", len(raw)) + raw)
        return
    if isinstance(value, (list, tuple)):
        if value and set(map(type, value)) == {int}:   # a generator's state (Python's: 625 ints), at once
            h.update(b"I" + repr(list(value)).encode())
            return
        h.update(b"[" + struct.pack("<Q", len(value)))
        for v in value:
            _feed(h, v)
        h.update(b"]")
        return
    if hasattr(value, "state_dict") and callable(value.state_dict) and not isinstance(value, type):
        h.update(b"S")
        _feed(h, value.state_dict())
        return
    if torch is not None and isinstance(value, (torch.dtype, torch.device, torch.Size)):
        _feed(h, str(value))
        return
    if type(value).__module__.split(".")[0] == "numpy":
        import numpy as np
        if isinstance(value, np.ndarray):
            a = np.ascontiguousarray(value)
            h.update(b"a%b:%b;" % (a.dtype.str.encode(), str(a.shape).encode()))
            h.update(a.reshape(-1).view(np.uint8))
            return
        if isinstance(value, np.generic):
            _feed(h, value.item() if value.dtype.kind in "biuf" else str(value))
            return
    raise TypeError(f"state_digest: cannot digest a {type(value).__module__}.{type(value).__qualname__} "
                    "(give tensors, arrays, numbers, strings, dicts, lists, or objects with a state_dict())")
