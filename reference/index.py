"""index.json: the commit point of a sharded checkpoint, and its strict validation."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .errors import IncompleteCheckpointError, InvalidIndexError
from .schema import check_supported

INDEX_NAME = "index.json"
META_NAME = "meta.pt"
ROLES = ("shard", "meta")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_MAX_INDEX_BYTES = 64 << 20


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
    root = os.path.realpath(directory)
    for name in seen_names:
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
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidIndexError(path, f"not valid JSON: {exc}") from exc
    return validate_index(index, directory)


def encode_index(index: dict[str, Any]) -> bytes:
    return (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
