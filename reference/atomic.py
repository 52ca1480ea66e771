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
from pathlib import Path
from typing import Callable, Iterator

# ".<final name>.tmp-<pid>-<16 hex>": the pid lets cleanup leave a live writer's file alone.
_TEMP_RE = re.compile(r"^\.(?P<final>.+)\.tmp-(?P<pid>\d+)-(?P<token>[0-9a-f]{16})$")
_SMALL_WRITE = 1 << 20
_WRITEBACK_CHUNK = 32 << 20


def temp_name_for(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")


def is_temp_name(name: str) -> bool:
    return _TEMP_RE.match(name) is not None


def fsync_dir(directory: str | os.PathLike) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter:
    """Binary file-like sink that hashes bytes as they are written (never read back).

    Small writes are coalesced into one buffer so a save issues few large write(2) calls; large
    buffers go straight to the file without a copy. Every 32 MiB it asks the kernel to start
    writeback so the final fsync has little left to wait for.
    """

    def __init__(self, fd: int):
        self._fd = fd
        self._hash = hashlib.sha256()
        self._pending = bytearray()
        self._written = 0
        self._flushed_for_writeback = 0

    @property
    def bytes_written(self) -> int:
        return self._written + len(self._pending)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

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
        self._hash.update(view)
        while view.nbytes:
            n = os.write(self._fd, view)
            view = view[n:]
            self._written += n
        if self._written - self._flushed_for_writeback >= _WRITEBACK_CHUNK:
            _start_writeback(self._fd, self._flushed_for_writeback, self._written - self._flushed_for_writeback)
            self._flushed_for_writeback = self._written


def _start_writeback(fd: int, offset: int, length: int) -> None:
    # On Linux POSIX_FADV_DONTNEED starts asynchronous writeback of dirty pages in the range.
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def atomic_write(path: str | os.PathLike, write: Callable[[HashingWriter], None], *,
                 sync_dir: bool = True) -> tuple[int, str]:
    """Atomically create or replace `path` with what `write(sink)` writes; returns (bytes, sha256).

    If `write`, a write(2), an fsync or the rename fails, the temp file is removed and `path` is
    untouched.
    """
    final = Path(path)
    tmp = temp_name_for(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            sink = HashingWriter(fd)
            write(sink)
            sink.flush()
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(final.parent)
    return sink.bytes_written, sink.hexdigest()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, sync_dir: bool = True) -> tuple[int, str]:
    return atomic_write(path, lambda sink: sink.write(data), sync_dir=sync_dir)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Remove this library's temp files whose writer process is gone; touch nothing else."""
    removed: list[Path] = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for entry in os.scandir(directory):
        m = _TEMP_RE.match(entry.name)
        if m is None or not entry.is_file(follow_symlinks=False):
            continue
        if _pid_alive(int(m.group("pid"))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed
