"""The one place that calls torch.load: always weights_only=True, errors classified and typed."""
from __future__ import annotations

import inspect
import os
import pickle
import zipfile
from typing import Any

import torch

from ..errors import CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError

# Markers of the weights_only unpickler refusing something (a global, an opcode such as protocol
# 4's STACK_GLOBAL or protocol 0's INST/DICT, an object build, a persistent id). torch prefixes every
# refusal with "Weights only load failed". Files reach torch.load only after their checksum has been
# verified, so a refusal means the writer put something there that needs arbitrary unpickling.
_UNSAFE_MARKERS = ("Weights only load failed", "WeightsUnpickler", "Unsupported global", "GLOBAL",
                   "not an allowed global", "safe_globals", "Unsupported operand", "is blocked",
                   "Can only create new object", "Can only build", "persistent_load",
                   "unsupported persistent id")
_DOCS_PREFIXES = ("Check the documentation", "Weights only load failed", "Please file an issue",
                  "Please use", "(1)", "(2)")


def _detail(text: str, exc: BaseException) -> str:
    """The informative line of a (long, multi-line) torch.load error message."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(_DOCS_PREFIXES)]
    if useful:
        return useful[0][:300]
    return lines[0][:300] if lines else repr(exc)


def safe_torch_load(path: str | os.PathLike, map_location=None, mmap: bool = False, *,
                    buffer: torch.Tensor | None = None) -> Any:
    """torch.load(weights_only=True) of `path`, or of `buffer` (the file's bytes, already read
    and verified, as a 1-D uint8 tensor; `path` then only names it in errors)."""
    path = os.fspath(path)
    try:
        if buffer is not None:
            return _load_from_buffer(buffer, map_location)
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError as exc:
        raise IncompleteCheckpointError(path, "file is missing") from exc
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if any(marker in text for marker in _UNSAFE_MARKERS):
            raise UnsafeCheckpointError(
                path, "refused: loading would need arbitrary unpickling (weights_only=True "
                      f"rejected it): {_detail(text, exc)}") from exc
        raise CorruptCheckpointError(path, f"cannot unpickle: {_detail(text, exc)}") from exc
    except (RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError, OSError,
            zipfile.BadZipFile, UnicodeDecodeError, AttributeError, MemoryError, OverflowError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise CorruptCheckpointError(path, f"not a readable torch checkpoint: {first}") from exc


class _MemoryFile:
    """Read-only, seekable file over a memoryview, for torch's zip reader. Unlike io.BytesIO it
    does not copy the buffer; only the ranges actually read (zip directory, pickle) are copied."""

    def __init__(self, view: memoryview):
        self._view = view
        self._pos = 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._view.nbytes}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._view.nbytes if n is None or n < 0 else min(self._view.nbytes, self._pos + n)
        data = bytes(self._view[self._pos:end]) if end > self._pos else b""
        self._pos += len(data)
        return data

    def readline(self, size: int = -1) -> bytes:
        end = self._view.nbytes if size is None or size < 0 else min(self._view.nbytes, self._pos + size)
        newline = bytes(self._view[self._pos:end]).find(b"\n")  # only legacy (non-zip) files get here
        return self.read(end - self._pos if newline < 0 else newline + 1)

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(out.nbytes, self._view.nbytes - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def _zero_copy_supported() -> bool:
    ser = torch.serialization
    try:
        return (all(hasattr(ser, name) for name in ("_is_zipfile", "_open_zipfile_reader",
                                                     "_is_torchscript_zip", "_weights_only_unpickler"))
                and "overall_storage" in inspect.signature(ser._load).parameters)
    except (AttributeError, TypeError, ValueError):
        return False


_ZERO_COPY = _zero_copy_supported()


def _load_from_buffer(buffer: torch.Tensor, map_location) -> Any:
    """Deserialize a torch.save zip held in `buffer` (1-D uint8) with the weights_only unpickler.

    The tensors of the result are views into `buffer` (as torch.load(mmap=True) makes them views
    into a file mapping, but of private memory), so a load needs no second copy of the data. Where
    this torch lacks the internals for that, or the bytes are not a torch zip, torch.load reads
    them from memory instead (copying)."""
    f = _MemoryFile(memoryview(buffer.numpy()).cast("B"))
    ser = torch.serialization
    if _ZERO_COPY and buffer.numel() and ser._is_zipfile(f):
        with ser._open_zipfile_reader(f) as zip_file:
            if not ser._is_torchscript_zip(zip_file):
                try:
                    return ser._load(zip_file, map_location, ser._weights_only_unpickler,
                                     overall_storage=buffer.untyped_storage(), encoding="utf-8")
                except pickle.UnpicklingError as exc:
                    # As torch.load(weights_only=True) words it: every refusal by the restricted
                    # unpickler is reported as a failed weights-only load.
                    raise pickle.UnpicklingError(f"Weights only load failed.\n\n{exc}") from None
    f.seek(0)
    return torch.load(f, map_location=map_location, weights_only=True)
