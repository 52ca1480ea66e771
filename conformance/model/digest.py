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

Any object a real optimizer or scheduler holds is digested: through its `state_dict()` where it has
one, else through its attributes (a ZeRO optimizer's state dict holds DeepSpeed's `LossScaler`
object). A value with no state to read (a function, an open file, a lock, a thread) is left out:
its type goes into the digest, and it is named (StateDigest.left_out, and one StateLeftOut warning).
A digest is the same in every process: no address, and no order of Python's per-process string
hashing, goes into it.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import hashlib
import random
import re
import struct
import sys
import types
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["LeftOut", "StateDigest", "StateLeftOut", "Why", "digest", "rng_state", "state_digest"]

# Bounds on what is read through objects' attributes (a component, and what a state_dict() returns,
# are digested whole, as they always were): an attribute can lead anywhere (a data set, the whole
# program), and a digest runs at every step that logs one.
MAX_DEPTH = 32              # levels of nesting below the outermost object read through its attributes
MAX_VALUES = 100_000        # container items and attributes read below such objects, per component
MAX_BYTES = 256 << 20       # tensor and array bytes read below such objects, per component


class Why(enum.Enum):
    """Why a value was left out of a digest."""

    CODE = "a function or method: code, not state"
    RESOURCE = "an open resource (a file, socket, lock, thread, process or logger), not state"
    RUNNING = "an iterator or generator: where it stands cannot be read"
    OPAQUE = "it has no state_dict() and no attributes to read"
    DEEP = f"nested more than {MAX_DEPTH} levels below an object read through its attributes"
    LARGE = (f"past the bound of {MAX_VALUES} values or {MAX_BYTES >> 20} MiB of tensors read through objects' "
             "attributes")


@dataclasses.dataclass(frozen=True)
class LeftOut:
    """A value inside a component that its digest did not read: where it is (`path`, e.g.
    `optimizer.state_dict()['loss_scaler'].lock`), its type, and why."""

    path: str
    kind: str
    why: Why
    more: int = 0     # Why.LARGE: how many later values were left out for the same bound

    def describe(self) -> str:
        later = f"; so were {self.more} later value(s) read through attributes" if self.more else ""
        return f"{self.path} ({self.kind}: {self.why.value}{later})"


class StateDigest(dict):
    """state_digest's result, `{name: hex digest}` (a dict: JSON writes it as one), with
    `left_out`: the values inside the components that were not read."""

    left_out: tuple[LeftOut, ...] = ()


class StateLeftOut(UserWarning):
    """A state digest left values out (each named): their contents are not compared."""


def state_digest(**components: Any) -> StateDigest:
    """`{name: hex digest}` of each component given. A torch module, optimizer or LR scheduler is
    digested by its `state_dict()`; `rng=True` stands for every generator (rng_state()); tensors,
    arrays, numbers, strings, and dicts, lists, tuples and sets of them as they are; any other
    object through its `state_dict()`, else its attributes. A component given as None is left out;
    a value inside one that has no state to read is named in `left_out` (and warned of once)."""
    out, left = StateDigest(), []
    for name, value in components.items():
        if value is None or value is False:
            continue
        if name == "rng" and value is True:
            value = rng_state()
        out[name], found = _digest(value, name)
        left += found
    out.left_out = tuple(left)
    _warn(out.left_out)
    return out


def digest(value: Any) -> str:
    """The hex SHA-256 of one component's exact bytes (a value it left out is warned of)."""
    hexdigest, left = _digest(value, "value")
    _warn(left)
    return hexdigest


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


def _digest(value: Any, name: str) -> tuple[str, tuple[LeftOut, ...]]:
    walk = _Walk(name)
    walk.feed(value)
    return walk.h.hexdigest(), walk.finished()


def _warn(left: tuple[LeftOut, ...]) -> None:
    if left:
        named = "; ".join(item.describe() for item in left[:5]) + (f"; and {len(left) - 5} more" if len(left) > 5 else "")
        # At the trainer's line that asked (stacklevel 3). Python shows a message once per place it
        # is issued from, so a digest logged at every step warns once.
        warnings.warn(StateLeftOut(f"state_digest left out {len(left)} value(s) (their type is digested, their contents "
                                   f"are not compared): {named}"), stacklevel=3)


def _qualname(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


# A default repr names an object's address: never part of a digest, nor of the order of one.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


class _Walk:
    """One component's digest: the hash, the path to the value being fed, what is open on the way
    there (a cycle is fed as a reference back), the bounds left, and what was left out."""

    def __init__(self, name: str):
        self.h = hashlib.sha256()
        self.path: list = [name]            # str, int (an index) or (key,) steps
        self.open: dict[int, int] = {}      # id of a container or object being fed -> its depth
        self.attrs_at: int | None = None    # depth of the outermost object read through its attributes
        self.values, self.bytes = MAX_VALUES, MAX_BYTES
        self.left_out: list[LeftOut] = []
        self.over = -1                      # Why.LARGE: values left out past the bound, after the first

    def finished(self) -> tuple[LeftOut, ...]:
        if self.over > 0:
            i = next(i for i, item in enumerate(self.left_out) if item.why is Why.LARGE)
            self.left_out[i] = dataclasses.replace(self.left_out[i], more=self.over)
        return tuple(self.left_out)

    def feed(self, value: Any) -> None:
        """Feed a tagged, unambiguous encoding of `value` into the hash. The common kinds of a
        state dict (tensors, dicts, numbers) are tried first: a digest runs after every step. Their
        encoding is the one every earlier version wrote: recorded digests stay valid."""
        h = self.h
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            if hasattr(value, "to_local"):   # a DTensor (FSDP2): this rank's own shard is its state
                value = value.to_local()
            if self.attrs_at is not None and not self._spend(0, value.numel() * value.element_size(), value):
                return
            t = value.detach().cpu().contiguous()
            h.update(b"t%b:%b;" % (str(t.dtype).encode(), str(tuple(t.shape)).encode()))
            h.update(t.reshape(-1).view(torch.uint8).numpy())
            return
        if isinstance(value, Mapping):
            if self._entered(value):
                # Keys in a fixed order whatever the insertion order (optimizer state is keyed by ints).
                items = sorted(value.items(), key=_key_order)
                h.update(b"{" + struct.pack("<Q", len(items)))
                path = self.path
                for i, (k, v) in enumerate(items):
                    if type(k) is str or type(k) is int:
                        self.feed(k)
                    else:   # a key that may leave something out: named by its place in the order
                        self._child(k, f"[<key {i}>]")
                    path.append((k,))
                    self.feed(v)
                    path.pop()
                h.update(b"}")
                del self.open[id(value)]
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
                if self.attrs_at is None or self._spend(len(value), 0, value):
                    h.update(b"I" + repr(list(value)).encode())
                return
            self._sequence(value)
            return
        if hasattr(value, "state_dict") and callable(value.state_dict) and not isinstance(value, type):
            if self._entered(value, 1):
                h.update(b"S")
                self._child(value.state_dict(), ".state_dict()")
                del self.open[id(value)]
            return
        if torch is not None and isinstance(value, (torch.dtype, torch.device, torch.Size)):
            self.feed(str(value))
            return
        if type(value).__module__.split(".")[0] == "numpy":
            import numpy as np
            if isinstance(value, np.ndarray):
                if self.attrs_at is not None and not self._spend(0, value.nbytes, value):
                    return
                a = np.ascontiguousarray(value)
                h.update(b"a%b:%b;" % (a.dtype.str.encode(), str(a.shape).encode()))
                h.update(a.reshape(-1).view(np.uint8))
                return
            if isinstance(value, np.generic):
                self.feed(value.item() if value.dtype.kind in "biuf" else str(value))
                return
        self._other(value)

    # -- what a state dict rarely holds: Python's other values, and objects --------------------------
    def _other(self, value: Any) -> None:
        """Every kind the common ones leave: kinds no earlier version digested (it refused them)."""
        kind = type(value)
        if isinstance(value, (set, frozenset)):
            if self._entered(value):
                # A set of strings iterates in another order in every process: its elements' own digests order it.
                digests = sorted(self._apart(v) for v in value)
                self.h.update(b"(" + struct.pack("<Q", len(digests)) + b"".join(digests) + b")")
                del self.open[id(value)]
            return
        if isinstance(value, collections.deque):
            self._sequence(value)
            return
        if isinstance(value, enum.Enum):   # an IntEnum or a StrEnum was digested as its int or str, above
            self._tagged(b"e", f"{_qualname(kind)}.{value.name}")
            return
        if isinstance(value, complex):
            self.h.update(b"c" + struct.pack("<dd", value.real, value.imag))
            return
        if kind in _exact_reprs() or _exact_meta(value):   # values whose repr is exact and holds no address
            self._tagged(b"r", f"{_qualname(kind)} {value!r}")
            return
        if isinstance(value, type):
            self._tagged(b"k", _qualname(value))
            return
        if isinstance(value, types.ModuleType):
            self._tagged(b"m", value.__name__)
            return
        generator = _generator_state(value)
        if generator is not None:
            self._tagged(b"g", _qualname(kind))
            self._child(generator, ".state")
            return
        why = _nothing_to_read(value)
        if why is None:
            attributes = _attributes(value)
            if attributes is not None:
                self._object(value, attributes)
                return
            why = Why.RUNNING if hasattr(value, "__next__") else Why.OPAQUE
        self._leave_out(value, why)

    def _object(self, value: Any, attributes: dict[str, Any]) -> None:
        """An object without a state_dict(): its class's name and its attributes, by name."""
        if not self._entered(value, len(attributes)):
            return
        outermost = self.attrs_at is None
        if outermost:
            self.attrs_at = len(self.path)
        self._tagged(b"o", _qualname(type(value)))
        self.h.update(b"{" + struct.pack("<Q", len(attributes)))
        for name in sorted(attributes):
            self.feed(name)
            self._child(attributes[name], f".{name}")
        self.h.update(b"}")
        if outermost:
            self.attrs_at = None
        del self.open[id(value)]

    def _sequence(self, value) -> None:
        if self._entered(value):
            self.h.update(b"[" + struct.pack("<Q", len(value)))
            for i, v in enumerate(value):
                self._child(v, i)
            self.h.update(b"]")
            del self.open[id(value)]

    # -- the walk's bookkeeping ---------------------------------------------------------------------
    def _child(self, value: Any, step) -> None:
        # No try/finally: an exception ends the whole walk, path and all.
        self.path.append(step)
        self.feed(value)
        self.path.pop()

    def _entered(self, value: Any, size: int | None = None) -> bool:
        """Whether to feed `value`'s contents (and it is now open): not when it is open already (a
        cycle: a reference back to it is fed instead), nor past a bound below an object read
        through its attributes (it is left out)."""
        depth = self.open.get(id(value))
        if depth is not None:
            self.h.update(b"@" + struct.pack("<Q", len(self.path) - depth))
            return False
        if self.attrs_at is not None:
            if len(self.path) - self.attrs_at > MAX_DEPTH:
                self._leave_out(value, Why.DEEP)
                return False
            if not self._spend(len(value) if size is None else size, 0, value):
                return False
        self.open[id(value)] = len(self.path)
        return True

    def _spend(self, values: int, size: int, value: Any) -> bool:
        """Take `values` items and `size` bytes from the bounds; past them, `value` is left out, and
        so is every later one (the same ones in every process: the walk's order is fixed)."""
        if self.over >= 0 or values > self.values or size > self.bytes:
            self._leave_out(value, Why.LARGE)
            return False
        self.values -= values
        self.bytes -= size
        return True

    def _leave_out(self, value: Any, why: Why) -> None:
        kind = _qualname(type(value))
        name = getattr(value, "__qualname__", None) if why is Why.CODE else None
        self._tagged(b"x", f"{kind} {name}" if isinstance(name, str) else kind)
        if why is Why.LARGE:
            self.over += 1
            if self.over:   # named once, with a count of the later ones
                return
        self.left_out.append(LeftOut(_path_text(self.path), kind, why))

    def _tagged(self, tag: bytes, text: str) -> None:
        raw = text.encode()
        self.h.update(tag + struct.pack("<Q", len(raw)) + raw)

    def _apart(self, value: Any) -> bytes:
        """`value`'s own raw digest, fed within this walk (its path, bounds and what it leaves out)."""
        h, self.h = self.h, hashlib.sha256()
        try:
            self._child(value, "{...}")
            return self.h.digest()
        finally:
            self.h = h


_PLAIN_KEYS = frozenset({str, int, bytes})   # a repr of one of these that looks like an address is the key's own


def _key_order(item) -> tuple[str, str]:
    """A key's place in a mapping: its type's name and repr (what every earlier version used), or
    for a repr that names an address, the key's digest."""
    key = item[0]
    text = repr(key)
    if type(key) not in _PLAIN_KEYS and _ADDRESS.search(text):
        text = "\0" + _digest(key, "key")[0]
    return type(key).__name__, text


def _path_text(path: list) -> str:
    parts = []
    for step in path:
        if isinstance(step, int):
            parts.append(f"[{step}]")
        elif isinstance(step, tuple):
            text = repr(step[0])
            parts.append(f"[{text}]" if len(text) <= 60 and not _ADDRESS.search(text) else f"[<{type(step[0]).__name__}>]")
        else:
            parts.append(step)
    return "".join(parts)


def _attributes(value: Any) -> dict[str, Any] | None:
    """An object's attributes (its __dict__ and its slots), or None if it has neither."""
    found = None
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            name = f"_{cls.__name__.lstrip('_')}{slot}" if slot.startswith("__") and not slot.endswith("__") else slot
            found = {} if found is None else found
            try:
                found.setdefault(name, getattr(value, name))
            except AttributeError:   # a slot never set
                pass
    own = getattr(value, "__dict__", None)
    if isinstance(own, dict):
        found = {**own, **(found or {})}
    return found


@functools.cache
def _exact_reprs() -> tuple[type, ...]:
    import datetime
    import decimal
    import fractions
    import pathlib
    import uuid
    return (decimal.Decimal, fractions.Fraction, datetime.datetime, datetime.date, datetime.time, datetime.timedelta,
            datetime.timezone, uuid.UUID, pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath, range, slice)


def _generator_state(value: Any) -> Any:
    """A random generator's state (Python's, NumPy's, torch's), or None for anything else."""
    if isinstance(value, random.Random) and not isinstance(value, random.SystemRandom):
        return value.getstate()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Generator):
        return value.get_state()
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(value, np.random.RandomState):
            return value.get_state()
        if isinstance(value, np.random.Generator):
            return value.bit_generator.state
    return None


def _exact_meta(value: Any) -> bool:
    """A NumPy dtype, or a torch layout or memory format: described exactly by its repr."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return (np is not None and isinstance(value, np.dtype)) or \
        (torch is not None and isinstance(value, (torch.layout, torch.memory_format)))


# Modules whose objects are resources: a file, a lock, a thread or a logger holds no training state,
# and reading its attributes would read the process (a thread's id, every logger in the program).
_RESOURCE_MODULES = frozenset({"_io", "io", "_thread", "threading", "socket", "_socket", "subprocess", "multiprocessing",
                               "logging", "asyncio", "concurrent", "selectors", "mmap", "weakref", "_weakref"})
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.MethodWrapperType,
         types.WrapperDescriptorType, types.MethodDescriptorType, staticmethod, classmethod, property, functools.partial)


def _nothing_to_read(value: Any) -> Why | None:
    """Why `value` has no state a digest can read, or None when its attributes are its state."""
    if isinstance(value, _CODE):
        return Why.CODE
    if isinstance(value, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
        return Why.RUNNING
    if any(cls.__module__.split(".")[0] in _RESOURCE_MODULES for cls in type(value).__mro__):
        return Why.RESOURCE
    return None
