"""Typed errors. Every message names the file and what is wrong with it."""
from __future__ import annotations

import os


class CheckpointError(Exception):
    """Base class: something about a checkpoint prevents using it."""

    def __init__(self, path: str | os.PathLike | None, problem: str):
        self.path = None if path is None else os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)


class CorruptCheckpointError(CheckpointError):
    """Bytes on disk disagree with what was committed (hash, size, structure)."""


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint was never committed (no index, missing file) or was cut short."""


class InvalidIndexError(CorruptCheckpointError):
    """index.json is malformed: missing keys, wrong types, unsafe or duplicate names."""


class SchemaError(CheckpointError):
    """The payload's schema is unknown, newer than this library, or cannot be migrated."""


class UnsafeCheckpointError(CheckpointError):
    """Loading would need arbitrary unpickling (weights_only refused it)."""


class RNGRestoreError(CheckpointError):
    """RNG state could not be restored exactly; a resumed run would silently diverge."""
