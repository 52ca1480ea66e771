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


class CheckpointWriteError(CheckpointError, OSError):
    """Saving failed: a write, fsync, rename or mkdir returned an error (a full disk, a quota, EIO
    from network storage). The message names the file and the error, and `errno` is the OS's (it
    is an OSError too). `committed` says whether the new checkpoint was committed before the
    failing step (a later directory fsync or retention); if not, nothing partial is left at a
    final name and the previous checkpoint is untouched."""

    def __init__(self, path: str | os.PathLike | None, problem: str, errno: int | None = None,
                 committed: bool = False):
        CheckpointError.__init__(self, path, problem)
        self.errno, self.committed = errno, committed


def write_error(path: str | os.PathLike, exc: OSError, committed: bool = False) -> CheckpointWriteError:
    """A CheckpointWriteError for an OSError raised while saving to `path`."""
    if isinstance(exc, CheckpointWriteError):
        exc = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    name = os.strerror(exc.errno) if exc.errno else str(exc)
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    if committed:
        problem = (f"the checkpoint was committed, but a later step of the save failed: [Errno {exc.errno}] "
                   f"{name}{where}")
    else:
        problem = f"saving failed: [Errno {exc.errno}] {name}{where}; nothing was committed"
    return CheckpointWriteError(path, problem, exc.errno, committed)
