"""Write a file so that a crash at any instant leaves the old file or the new one, never a torn one.

Protocol: unique temp file in the target's own directory (rename is atomic only within one
filesystem), write, flush, fsync, os.replace, fsync the directory.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path

from ..errors import CheckpointWriteError, write_error

# ".<final name>.tmp-<pid>-<16 hex>": the pid lets cleanup leave a live writer's file alone.
# ASCII digits only ("\d" would also match other scripts' digits, which int() accepts), and
# fullmatch: "$" alone also matches before a trailing newline.
_TEMP_RE = re.compile(r"\.(?P<final>.+)\.tmp-(?P<pid>[0-9]+)-(?P<token>[0-9a-f]{16})", re.DOTALL)
_SMALL_WRITE = 1 << 20
# Every this many bytes a helper thread fdatasyncs the file while the writer goes on, so the device
# flushes (the slow part of a durable write, on virtual disks especially) overlap the writing and
# the final fsync has at most this much left. One flush in flight at a time: the writer waits for
# the previous one at the next boundary, which bounds dirty data and keeps the count deterministic.
_FLUSH_EVERY = 64 << 20
# Writes at least this large are hashed by a helper thread while write(2) copies them (both
# release the GIL), instead of one after the other.
_OVERLAP_MIN = 4 << 20


def temp_name_for(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")


def is_temp_name(name: str) -> bool:
    return _TEMP_RE.fullmatch(name) is not None


def fsync_dir(directory: str | os.PathLike) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter:
    """Binary file-like sink that hashes bytes as they are written (never read back).

    Small writes are coalesced into one buffer so a save issues few large write(2) calls; large
    buffers go straight to the file without a copy, and are hashed by a helper thread while the
    calling thread writes them (every write(2) stays in the calling thread). Every 64 MiB another
    helper thread fdatasyncs the file in the background (see _FLUSH_EVERY); finish() waits for it
    and raises its error, if any. close() stops the helpers.
    """

    def __init__(self, fd: int, *, hashing: bool = True):
        self._fd = fd
        self._hash = hashlib.sha256() if hashing else None
        self._pending = bytearray()
        self._written = 0
        self._flushed_for_writeback = 0
        self._helper: ThreadPoolExecutor | None = None
        self._flusher: ThreadPoolExecutor | None = None
        self._flushing: Future | None = None

    def finish(self) -> None:
        """Write what is buffered and wait for the background flush; raise if it failed (after a
        failed fdatasync the kernel may report the next fsync as clean, so it must surface here)."""
        self._drain()
        if self._flushing is not None:
            flushing, self._flushing = self._flushing, None
            flushing.result()

    def close(self) -> None:
        """Stop the helper threads (waiting for any work in flight). Does not close the fd."""
        for pool in (self._helper, self._flusher):
            if pool is not None:
                pool.shutdown()
        self._helper = self._flusher = None

    @property
    def bytes_written(self) -> int:
        return self._written + len(self._pending)

    def hexdigest(self) -> str:
        return self._hash.hexdigest() if self._hash is not None else ""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n < _SMALL_WRITE:
            self._pending += view
            if len(self._pending) >= _SMALL_WRITE:
                self._drain()
            return n
        self._drain()
        self._write_all(view)
        return n

    def flush(self) -> None:
        self._drain()

    def _drain(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self._write_all(memoryview(pending))

    def _write_all(self, view: memoryview) -> None:
        hashing = None
        if self._hash is None:
            pass
        elif view.nbytes >= _OVERLAP_MIN:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hashing-writer")
            hashing = self._helper.submit(self._hash.update, view)
        else:
            self._hash.update(view)
        try:
            while view.nbytes:
                n = os.write(self._fd, view)
                view = view[n:]
                self._written += n
        finally:
            if hashing is not None:
                futures_wait([hashing])  # the caller's buffer must outlive its hashing
        if hashing is not None:
            hashing.result()
        if self._written - self._flushed_for_writeback >= _FLUSH_EVERY:
            self._flushed_for_writeback = self._written
            if self._flushing is not None:
                self._flushing.result()
            if self._flusher is None:
                self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hashing-writer-flush")
            self._flushing = self._flusher.submit(_fdatasync, self._fd)


_fdatasync = getattr(os, "fdatasync", os.fsync)


def atomic_write(path: str | os.PathLike, write: Callable[[HashingWriter], None], *,
                 sync_dir: bool = True, hashing: bool = True) -> tuple[int, str]:
    """Atomically create or replace `path` with what `write(sink)` writes; returns (bytes, sha256)
    (the sha256 is "" with `hashing=False`, for a caller that hashed the content itself).

    If `write`, a write(2), an fsync or the rename fails, the temp file is removed and `path` is
    untouched; an OS error is raised as CheckpointWriteError (an OSError too). If only the final
    directory fsync fails, the new file is in place: the error says it was committed.
    """
    final = Path(path)
    tmp = temp_name_for(final)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise write_error(final, exc) from exc
    try:
        try:
            sink = HashingWriter(fd, hashing=hashing)
            try:
                write(sink)
                sink.finish()
            finally:
                sink.close()
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointWriteError):
            raise write_error(final, exc) from exc
        raise
    if sync_dir:
        try:
            fsync_dir(final.parent)
        except OSError as exc:
            raise write_error(final, exc, committed=True) from exc
    return sink.bytes_written, sink.hexdigest()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, sync_dir: bool = True) -> tuple[int, str]:
    return atomic_write(path, lambda sink: sink.write(data), sync_dir=sync_dir)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if pid <= 0:
        return True  # os.kill(0 or -n) signals process groups: never treat that as "dead"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # exists but not ours, or not a pid this OS can have: leave the file alone
    return True


def is_live_temp(name: str) -> bool:
    """Whether `name` is one of this library's temp files whose writer is still running: cleanup
    (here, and a chain's sweep of unreferenced pieces) leaves it alone."""
    m = _TEMP_RE.fullmatch(name)
    return m is not None and _pid_alive(int(m.group("pid")))


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Remove this library's temp files whose writer process is gone; touch nothing else."""
    removed: list[Path] = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for entry in os.scandir(directory):
        if not is_temp_name(entry.name) or not entry.is_file(follow_symlinks=False) or is_live_temp(entry.name):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed
