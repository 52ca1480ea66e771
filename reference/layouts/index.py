"""index.json: the commit point of a sharded checkpoint, and its strict validation.

Since schema 2 the index carries `index_sha256`, the sha256 of its own canonical JSON encoding
without that key, so a flipped bit that still parses (a digit of global_step, a letter of a key
name, the metric) is refused; a change that keeps the content identical (whitespace) is harmless.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import IncompleteCheckpointError, InvalidIndexError
from ..primitives.schema import check_supported, parse_version

INDEX_NAME = "index.json"
META_NAME = "meta.pt"
ROLES = ("shard", "meta")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_MAX_INDEX_BYTES = 64 << 20
CHECKSUM_KEY = "index_sha256"


def index_checksum(index: dict[str, Any]) -> str:
    """sha256 of the canonical JSON encoding of `index` without its checksum key."""
    body = {k: v for k, v in index.items() if k != CHECKSUM_KEY}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _real_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def build_index(*, schema: str, global_step: int, wall_saved_at: float | None,
                files: list[dict[str, Any]]) -> dict[str, Any]:
    return {"schema": schema, "layout": "sharded", "global_step": int(global_step),
            "wall_saved_at": wall_saved_at, "files": files}


def _check_name(directory: Path, name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidIndexError(directory / INDEX_NAME, f"{where}: name must be a non-empty string, got {name!r}")
    if "/" in name or "\\" in name or "\x00" in name or name in (".", "..") or name.startswith("."):
        raise InvalidIndexError(directory / INDEX_NAME, f"{where}: unsafe file name {name!r} "
                                "(path separators, '..' and hidden names are not allowed)")
    if name == INDEX_NAME:
        raise InvalidIndexError(directory / INDEX_NAME, f"{where}: index.json cannot list itself")
    return name


def _require(cond: bool, directory: Path, problem: str) -> None:
    if not cond:
        raise InvalidIndexError(directory / INDEX_NAME, problem)


def validate_index(index: Any, directory: Path) -> dict[str, Any]:
    """Structural checks only (no file access beyond containment); raise InvalidIndexError."""
    _require(isinstance(index, dict), directory, f"index must be a JSON object, got {type(index).__name__}")
    for key, typ in (("schema", str), ("layout", str), ("global_step", int), ("files", list)):
        _require(key in index, directory, f"missing key {key!r}")
        _require(isinstance(index[key], typ) and not isinstance(index[key], bool), directory,
                 f"key {key!r} must be {typ.__name__}, got {type(index[key]).__name__}")
    check_supported(index["schema"], str(directory / INDEX_NAME))
    _require(index["layout"] == "sharded", directory, f"unknown layout {index['layout']!r}")
    _require(index["global_step"] >= 0, directory, f"negative global_step {index['global_step']}")
    seen_names: set[str] = set()
    seen_keys: set[str] = set()
    metas = 0
    for i, entry in enumerate(index["files"]):
        where = f"files[{i}]"
        _require(isinstance(entry, dict), directory, f"{where} must be an object")
        for key in ("name", "role", "bytes", "sha256"):
            _require(key in entry, directory, f"{where}: missing key {key!r}")
        name = _check_name(directory, entry["name"], where)
        _require(name not in seen_names, directory, f"{where}: duplicate file name {name!r}")
        seen_names.add(name)
        _require(entry["role"] in ROLES, directory, f"{where}: role must be one of {ROLES}, got {entry['role']!r}")
        size = entry["bytes"]
        _require(isinstance(size, int) and not isinstance(size, bool) and size >= 0, directory,
                 f"{where} ({name}): bytes must be a non-negative integer, got {size!r}")
        _require(isinstance(entry["sha256"], str) and _HEX64.match(entry["sha256"]) is not None,
                 directory, f"{where} ({name}): sha256 must be 64 lowercase hex digits")
        if entry["role"] == "meta":
            metas += 1
        else:
            keys = entry.get("keys")
            _require(isinstance(keys, list) and all(isinstance(k, str) for k in keys), directory,
                     f"{where} ({name}): shard needs 'keys', a list of strings")
            dup = seen_keys.intersection(keys)
            _require(not dup and len(set(keys)) == len(keys), directory,
                     f"{where} ({name}): parameter(s) listed twice: {sorted(dup or keys)[:3]}")
            seen_keys.update(keys)
    _require(metas == 1, directory, f"exactly one file with role 'meta' is required, found {metas}")
    if "key_order" in index:
        order = index["key_order"]
        _require(isinstance(order, list) and all(isinstance(k, str) for k in order), directory,
                 "key_order must be a list of strings")
        _require(len(set(order)) == len(order) and set(order) == seen_keys, directory,
                 "key_order disagrees with the parameter names listed in the shards")
    wall = index.get("wall_saved_at")
    _require(wall is None or _real_number(wall), directory,
             f"wall_saved_at must be a number or null, got {wall!r}")
    if "metric" in index:
        _require(_real_number(index["metric"]), directory,
                 f"metric must be a number, got {index['metric']!r}")
    _require(not isinstance(index.get("meta", {}), bool) and isinstance(index.get("meta", {}), dict), directory,
             f"meta must be an object, got {index.get('meta')!r}"[:200])
    # A name is one path component (checked above), so only a symlink can lead outside: resolve
    # those, not every name (a realpath per name is a stat per path component, on every load).
    root = None
    for name in seen_names:
        if not os.path.islink(directory / name):
            continue
        root = root or os.path.realpath(directory)
        real = os.path.realpath(directory / name)
        _require(os.path.commonpath([root, real]) == root, directory,
                 f"{name!r} resolves to {real}, outside the checkpoint directory")
    return index


def read_index(directory: str | os.PathLike) -> dict[str, Any]:
    directory = Path(directory)
    path = directory / INDEX_NAME
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_INDEX_BYTES + 1)
    except FileNotFoundError as exc:
        raise IncompleteCheckpointError(directory, "no index.json: the save never committed") from exc
    except IsADirectoryError as exc:
        raise InvalidIndexError(path, "index.json is a directory") from exc
    if len(raw) > _MAX_INDEX_BYTES:
        raise InvalidIndexError(path, f"larger than {_MAX_INDEX_BYTES} bytes")
    try:
        index = json.loads(raw.decode("utf-8"), object_pairs_hook=_object_without_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise InvalidIndexError(path, f"not valid JSON: {exc}") from exc
    if isinstance(index, dict) and CHECKSUM_KEY in index:
        stored = index[CHECKSUM_KEY]
        actual = index_checksum(index)
        if stored != actual:
            raise InvalidIndexError(path, f"{CHECKSUM_KEY} mismatch: stored {stored!r}, content "
                                          f"hashes to {actual}; the index was modified or corrupted")
    validate_index(index, directory)
    if CHECKSUM_KEY not in index and parse_version(index["schema"]) >= 2:
        raise InvalidIndexError(path, f"missing key {CHECKSUM_KEY!r} (every {index['schema']} "
                                      "index carries one)")
    return index


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r} in a JSON object")
        obj[key] = value
    return obj


def encode_index(index: dict[str, Any]) -> bytes:
    """index.json's bytes, sealed with `index_sha256` (recomputed, so edits can be re-sealed)."""
    if isinstance(index, dict):
        index = {**index, CHECKSUM_KEY: index_checksum(index)}
    return (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
