"""Schema versions and the migration registry.

Every payload and index carries `schema: "reference-checkpoint/<n>"`. Loading dispatches on it:
older versions are upgraded step by step through registered migrations, newer or unknown ones are
refused with an error naming both versions.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..errors import SchemaError

SCHEMA_PREFIX = "reference-checkpoint/"
CURRENT_VERSION = 2
CURRENT_SCHEMA = f"{SCHEMA_PREFIX}{CURRENT_VERSION}"
# fullmatch with ASCII digits: "$" would accept a trailing newline and "\d" other scripts' digits.
_SCHEMA_RE = re.compile(r"reference-checkpoint/([0-9]+)")

Migration = Callable[[dict[str, Any]], dict[str, Any]]
_MIGRATIONS: dict[int, Migration] = {}


def register_migration(from_version: int) -> Callable[[Migration], Migration]:
    """Register the function that upgrades a payload from `from_version` to `from_version + 1`."""
    def decorate(fn: Migration) -> Migration:
        if from_version in _MIGRATIONS:
            raise ValueError(f"a migration from version {from_version} is already registered")
        _MIGRATIONS[from_version] = fn
        return fn
    return decorate


def parse_version(schema: Any, path: str | None = None) -> int:
    if not isinstance(schema, str):
        raise SchemaError(path, f"schema must be a string like {CURRENT_SCHEMA!r}, got {schema!r}")
    m = _SCHEMA_RE.fullmatch(schema)
    if m is None:
        raise SchemaError(path, f"unknown schema {schema!r}; this library reads {SCHEMA_PREFIX}1 "
                                f"to {CURRENT_SCHEMA}")
    return int(m.group(1))


def check_supported(schema: Any, path: str | None = None) -> int:
    version = parse_version(schema, path)
    if version > CURRENT_VERSION:
        raise SchemaError(path, f"checkpoint schema {schema!r} is newer than this library's "
                                f"{CURRENT_SCHEMA!r}; upgrade the library to load it")
    if version < 1:
        raise SchemaError(path, f"unknown schema {schema!r}; this library reads {SCHEMA_PREFIX}1 "
                                f"to {CURRENT_SCHEMA}")
    return version


def migrate(payload: dict[str, Any], path: str | None = None) -> dict[str, Any]:
    """Upgrade `payload` to the current schema; raise SchemaError if that is impossible."""
    if not isinstance(payload, dict) or "schema" not in payload:
        raise SchemaError(path, "payload has no 'schema' field")
    version = check_supported(payload["schema"], path)
    while version < CURRENT_VERSION:
        step = _MIGRATIONS.get(version)
        if step is None:
            raise SchemaError(path, f"no migration registered from {SCHEMA_PREFIX}{version} "
                                    f"to {SCHEMA_PREFIX}{version + 1}")
        try:
            payload = step(dict(payload))
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(path, f"cannot migrate {SCHEMA_PREFIX}{version} -> "
                                    f"{SCHEMA_PREFIX}{version + 1}: {exc!r}") from exc
        version += 1
        payload["schema"] = f"{SCHEMA_PREFIX}{version}"
    return payload


@register_migration(1)
def _v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 kept counters flat: `step`, `epoch`, `samples_in_epoch`, `batch_size`.

    v2 groups them under `counters`, renames `step` -> `global_step`, and stores the position
    in the epoch as `batch_in_epoch`, derived as samples_in_epoch // batch_size. v1 had no
    `wall_saved_at`, no data-order state and called the loss list `losses`.
    """
    batch_size = int(payload.pop("batch_size"))
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    samples = int(payload.pop("samples_in_epoch"))
    payload["counters"] = {
        "global_step": int(payload.pop("step")),
        "epoch": int(payload.pop("epoch")),
        "batch_in_epoch": samples // batch_size,
    }
    payload["loss_history"] = [float(x) for x in payload.pop("losses", [])]
    payload.setdefault("wall_saved_at", None)
    payload.setdefault("data_order", None)
    payload.setdefault("scaler", None)
    payload.setdefault("extra", {})
    return payload
