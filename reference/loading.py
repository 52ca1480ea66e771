"""The one place that calls torch.load: always weights_only=True, errors classified and typed."""
from __future__ import annotations

import os
import pickle
import zipfile
from typing import Any

import torch

from .errors import CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError

_UNSAFE_MARKERS = ("Unsupported global", "GLOBAL", "not an allowed global", "safe_globals")


def safe_torch_load(path: str | os.PathLike, map_location=None, mmap: bool = False) -> Any:
    path = os.fspath(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError as exc:
        raise IncompleteCheckpointError(path, "file is missing") from exc
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if any(marker in text for marker in _UNSAFE_MARKERS):
            raise UnsafeCheckpointError(
                path, "refused: loading would need arbitrary unpickling (weights_only=True "
                      f"rejected it): {text.splitlines()[0] if text else exc!r}") from exc
        raise CorruptCheckpointError(path, f"cannot unpickle: {text.splitlines()[0] if text else exc!r}") from exc
    except (RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError, OSError,
            zipfile.BadZipFile, UnicodeDecodeError, AttributeError, MemoryError, OverflowError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise CorruptCheckpointError(path, f"not a readable torch checkpoint: {first}") from exc
