"""Chained checkpoints: full, incremental and differential, as one mechanism.

Layout of a run directory:
    pieces/<sha256>                  content-addressed pieces (codec.py): a tensor's bytes or the
                                     changed rows of one
    step-00000012.chain.json         one manifest per checkpoint, written last (the commit point)

A manifest holds the payload's skeleton (everything but the tensors, torch.save'd, base64) and
lists every tensor of the payload: either a whole piece, or the rows that changed
since its parent (`rows`: an index piece and a values piece) with the sha256 of the tensor they
rebuild. It names its parent (file name and the sha256 of the parent's manifest bytes) and how
many checkpoints it is past the last full one. Strategies differ only in the parent a delta is
taken against: the previous checkpoint (incremental) or the last full one (differential); a full
checkpoint has no parent and writes every piece it lists. A delta writes only pieces the store
lacks, so an unchanged tensor (a frozen layer) costs nothing.

A load follows the parent links, checking each parent's manifest hash, and decodes every piece it
uses against its hash (and every rebuilt tensor against its own); a missing or mismatched link
raises a typed error naming it. Retention keeps a checkpoint's whole chain and then sweeps pieces
no remaining manifest lists (gc.py).
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import names
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, InvalidIndexError
from ..primitives.encoding import from_torch_bytes
from ..primitives.integrity import tensor_bytes
from ..primitives.schema import check_supported, migrate
from ..primitives.tree import join_tensors
from . import codec

FORMAT = "reference.chain/1"
SUFFIX = names.CHAIN_SUFFIX
PIECES = "pieces"
STRATEGIES = ("full", "incremental", "differential")
CHECKSUM_KEY = "manifest_sha256"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# A 2-D-or-more tensor with at least this many rows may be saved as its changed rows.
ROW_DELTA_MIN_ROWS = 16
_MAX_MANIFEST = 64 << 20
PARALLEL_MIN_BYTES = 4 << 20


class BrokenChainError(CorruptCheckpointError):
    """A checkpoint's chain is not whole: a parent manifest is missing, or is not the one the
    child was saved against (its hash differs)."""


@dataclasses.dataclass(frozen=True)
class Parent:
    """What the next delta is taken against: a committed manifest and the state it holds."""

    name: str
    sha256: str
    since_full: int
    base: str                             # the full checkpoint this one's chain starts at
    rows: dict[str, torch.Tensor]         # key -> tensor, for tensors that may become row deltas


def pieces_dir(directory: Path) -> Path:
    return directory / PIECES


def manifest_name(step: int) -> str:
    return names.step_name(step, "chain")


def is_manifest_name(name: str) -> bool:
    parsed = names.parse(name)
    return parsed is not None and parsed[1] == "chain"


# -- manifests ----------------------------------------------------------------------------------
def manifest_checksum(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _bad(path: Path, problem: str) -> InvalidIndexError:
    return InvalidIndexError(path, problem)


def _check_piece_ref(ref: Any, path: Path, where: str) -> None:
    if not (isinstance(ref, dict) and isinstance(ref.get("piece"), str) and _HEX64.match(ref["piece"])
            and isinstance(ref.get("bytes"), int) and ref["bytes"] >= 0):
        raise _bad(path, f"{where}: not a piece reference: {ref!r}"[:300])


def check_parent_name(name: Any, path: Path) -> str:
    """A parent is another manifest in the same directory, named by its file name only."""
    if not isinstance(name, str) or not is_manifest_name(name):
        raise _bad(path, f"parent {name!r} is not a manifest in this checkpoint directory "
                         "(a parent is named by a file name step-N.chain.json, no path)")
    return name


def read_manifest(path: Path) -> tuple[dict[str, Any], str]:
    """A manifest, structurally checked, and the sha256 of its bytes (what a child records)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_MANIFEST + 1)
    except FileNotFoundError:
        raise IncompleteCheckpointError(path, "manifest missing") from None
    except OSError as exc:
        raise CorruptCheckpointError(path, f"cannot read: {exc}") from exc
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise _bad(path, f"not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _bad(path, f"not a {FORMAT} manifest")
    if manifest.get(CHECKSUM_KEY) != manifest_checksum(manifest):
        raise _bad(path, f"{CHECKSUM_KEY} mismatch: the manifest was modified or corrupted")
    check_supported(manifest.get("schema"), os.fspath(path))
    for key, typ in (("step", int), ("since_full", int), ("tensors", list), ("skeleton", str)):
        if not isinstance(manifest.get(key), typ) or isinstance(manifest.get(key), bool):
            raise _bad(path, f"key {key!r} must be {typ.__name__}")
    if not isinstance(manifest.get("meta", {}), dict):
        raise _bad(path, "meta must be an object")
    if manifest.get("kind") not in STRATEGIES:
        raise _bad(path, f"kind must be one of {STRATEGIES}, got {manifest.get('kind')!r}")
    parent = manifest.get("parent")
    if parent is not None:
        if not isinstance(parent, dict) or not isinstance(parent.get("sha256"), str):
            raise _bad(path, "parent must be null or {name, sha256}")
        check_parent_name(parent.get("name"), path)
        if parent["name"] == path.name:
            raise _bad(path, "a manifest cannot be its own parent")
    elif manifest["since_full"] != 0:
        raise _bad(path, "a manifest without a parent must be full (since_full 0)")
    for i, entry in enumerate(manifest["tensors"]):
        where = f"tensors[{i}]"
        if not (isinstance(entry, dict) and isinstance(entry.get("key"), str) and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("shape"), list) and isinstance(entry.get("sha256"), str)):
            raise _bad(path, f"{where}: needs key, dtype, shape and sha256")
        if "rows" in entry:
            if parent is None:
                raise _bad(path, f"{where} ({entry['key']}): a row delta in a checkpoint with no parent")
            _check_piece_ref(entry["rows"].get("index") if isinstance(entry["rows"], dict) else None, path, where)
            _check_piece_ref(entry["rows"].get("values"), path, where)
        else:
            _check_piece_ref(entry, path, where)
    return manifest, hashlib.sha256(raw).hexdigest()


def read_chain(path: Path) -> list[tuple[Path, dict[str, Any], str]]:
    """(path, manifest, sha256 of its bytes) of the manifest at `path` and of its ancestors,
    newest first, every link checked."""
    chain = []
    current, expected = path, None
    seen = set()
    while True:
        if current.name in seen:
            raise BrokenChainError(current, "the chain loops back on itself")
        seen.add(current.name)
        try:
            manifest, digest = read_manifest(current)
        except IncompleteCheckpointError:
            if expected is None:
                raise
            raise BrokenChainError(current, f"missing: {chain[-1][0].name} needs it as its parent") from None
        if expected is not None and digest != expected:
            raise BrokenChainError(current, f"is not the parent {chain[-1][0].name} was saved against "
                                            f"(its manifest sha256 {digest[:16]}..., expected {expected[:16]}...)")
        chain.append((current, manifest, digest))
        parent = manifest.get("parent")
        if parent is None:
            return chain
        current, expected = current.with_name(parent["name"]), parent["sha256"]


# -- pieces -------------------------------------------------------------------------------------
def read_piece(directory: Path, ref: dict[str, Any], *, verify: bool = True) -> np.ndarray:
    """A piece's raw bytes; `verify=False` skips only the sha256 (the caller checks a hash over
    what it builds from them), never the length checks."""
    path = pieces_dir(directory) / ref["piece"]
    try:
        raw = codec.read_piece_file(path, ref["piece"], verify=verify)
    except FileNotFoundError:
        raise IncompleteCheckpointError(path, "piece listed in a manifest is missing") from None
    except OSError as exc:
        raise CorruptCheckpointError(path, f"cannot read: {exc}") from exc
    if len(raw) != ref["bytes"]:
        raise CorruptCheckpointError(path, f"piece holds {len(raw)} bytes, the manifest says {ref['bytes']}")
    return raw


def _dtype(name: str, path: Path) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(path, f"unknown dtype {name!r}")
    return dtype


def _as_tensor(raw: np.ndarray, dtype: torch.dtype, shape: list[int], path: Path) -> torch.Tensor:
    flat = torch.from_numpy(raw)
    try:
        return flat.view(dtype).reshape(shape) if raw.size else torch.empty(shape, dtype=dtype)
    except RuntimeError as exc:
        raise CorruptCheckpointError(path, f"{raw.size} bytes do not make a {dtype} tensor of shape {shape}") from exc


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


@dataclasses.dataclass
class Opened:
    """A loaded checkpoint: its payload, and what the next delta may be taken against (the
    checkpoint itself, and the full one its chain starts at)."""

    payload: dict[str, Any]
    last: Parent
    base: Parent


def load_chain(path: str | os.PathLike, map_location=None, *, migrate_schema: bool = True) -> dict[str, Any]:
    """The payload of the checkpoint whose manifest is `path`: every link, piece and rebuilt
    tensor verified by hash before it is returned."""
    return open_chain(path, map_location, migrate_schema=migrate_schema).payload


def open_chain(path: str | os.PathLike, map_location=None, *, migrate_schema: bool = True) -> Opened:
    path = Path(path)
    chain = read_chain(path)
    directory = path.parent
    by_name = {p.name: m for p, m, _ in chain}
    entries = {p.name: {e["key"]: e for e in m["tensors"]} for p, m, _ in chain}

    def resolve(entry: dict[str, Any]) -> torch.Tensor:
        """The head's tensor: the nearest whole piece up the chain, then every later level's rows
        applied in order, and the result checked against the sha256 the head recorded (once:
        the whole piece is not hashed separately unless that check fails)."""
        key, name, current, deltas = entry["key"], path.name, entry, []
        while "rows" in current:
            deltas.append((name, current))
            parent = by_name[name]["parent"]["name"]
            current = entries[parent].get(key)
            if current is None:
                raise BrokenChainError(directory / name, f"tensor {key} is a row delta, but its parent "
                                                         f"{parent} has no such tensor")
            name = parent
        where = directory / name
        tensor = _as_tensor(read_piece(directory, current, verify=not deltas), _dtype(current["dtype"], where),
                            current["shape"], where)
        for delta_name, delta in reversed(deltas):
            where = directory / delta_name
            dtype = _dtype(delta["dtype"], where)
            if list(tensor.shape) != delta["shape"] or tensor.dtype != dtype:
                raise BrokenChainError(where, f"tensor {key}: its parent holds {tensor.dtype} {list(tensor.shape)}, "
                                              f"the delta needs {dtype} {delta['shape']}")
            index = _as_tensor(read_piece(directory, delta["rows"]["index"]), torch.int64, [-1], where)
            values = _as_tensor(read_piece(directory, delta["rows"]["values"]), dtype,
                                [index.numel(), *delta["shape"][1:]], where)
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= tensor.shape[0]):
                raise CorruptCheckpointError(where, f"tensor {key}: row index out of range")
            tensor[index] = values
        if deltas and tensor_sha256(tensor) != entry["sha256"]:
            read_piece(directory, current)     # a damaged whole piece is named as such
            raise BrokenChainError(directory / path.name, f"tensor {key}: the rows applied along the chain from "
                                                          f"{name} do not rebuild the tensor that was saved "
                                                          "(sha256 differs: a delta applied to the wrong parent)")
        return tensor

    _, head, digest = chain[0]
    # Pieces are read, decoded and hashed in parallel for real checkpoints (all of it releases the
    # GIL); small ones stay on this thread, where starting threads would cost more.
    workers = min(len(head["tensors"]), os.cpu_count() or 1)
    if workers > 1 and sum(e["bytes"] for e in head["tensors"]) >= PARALLEL_MIN_BYTES:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            tensors = list(pool.map(resolve, head["tensors"]))
    else:
        tensors = [resolve(e) for e in head["tensors"]]
    last = parent_from(path, head, digest, [(e["key"], t) for e, t in zip(head["tensors"], tensors)])
    root_path, root, root_digest = chain[-1]
    base = last if len(chain) == 1 else Parent(root_path.name, root_digest, 0, root_path.name, {})
    skeleton = load_skeleton(head, path)
    if map_location is not None:
        tensors = [t.to(map_location) for t in tensors]
    payload = join_tensors(skeleton, tensors, path)
    if not isinstance(payload, dict) or payload.get("schema") != head["schema"]:
        raise CorruptCheckpointError(path, "skeleton's schema disagrees with the manifest's")
    return Opened(migrate(payload, os.fspath(path)) if migrate_schema else payload, last, base)


def load_skeleton(manifest: dict[str, Any], path: Path) -> Any:
    """The payload without its tensors (markers in their place), from the manifest at `path`."""
    try:
        raw = base64.b64decode(manifest["skeleton"], validate=True)
    except ValueError as exc:
        raise CorruptCheckpointError(path, f"skeleton is not base64: {exc}") from None
    return from_torch_bytes(raw, path)   # it holds no tensor (markers in their place): the CPU is no choice


def references(manifest: dict[str, Any]) -> set[str]:
    """Every piece a manifest lists."""
    out: set[str] = set()
    for e in manifest["tensors"]:
        if "rows" in e:
            out.update((e["rows"]["index"]["piece"], e["rows"]["values"]["piece"]))
        else:
            out.add(e["piece"])
    return out


def parent_from(path: Path, manifest: dict[str, Any], digest: str,
                tensors: list[tuple[str, torch.Tensor]]) -> Parent:
    """What a later delta may be taken against: this checkpoint, with CPU copies of its tensors
    that could become row deltas."""
    rows = {k: t.detach().to("cpu", copy=True) for k, t in tensors
            if t.dim() >= 2 and t.shape[0] >= ROW_DELTA_MIN_ROWS}
    return Parent(path.name, digest, manifest["since_full"], manifest["base"], rows)


def changed_rows(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Indices of the rows whose bytes differ (bitwise: -0.0 and 0.0 differ, NaN equals itself)."""
    a = old.detach().contiguous().reshape(old.shape[0], -1).view(torch.uint8)
    b = new.detach().contiguous().reshape(new.shape[0], -1).view(torch.uint8)
    return (a != b).any(dim=1).nonzero().flatten()
