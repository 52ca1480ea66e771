"""Keeping timings honest: flushed, idle disks and cold reads (page-cache eviction checked with mincore)."""
from __future__ import annotations

import contextlib
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from .constants import _READ_CHUNK


def fs_type(path: Path) -> str:
    """Filesystem type of `path` from /proc/self/mountinfo (longest matching mount point)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                mount = fields[4].replace("\\040", " ")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, right.split()[0]
    return kind


def settle(directory: Path, timeout: float = 10.0) -> bool:
    """sync, then wait until the block device under `directory` has had no request in flight for
    30 ms (freed blocks are discarded in the background on `discard` mounts, and a timed step
    should not compete with the previous step's leftovers). True if it settled in time."""
    os.sync()
    dev = os.stat(directory).st_dev
    inflight = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/inflight")
    if not inflight.exists():
        return False
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        try:
            busy = any(int(x) for x in inflight.read_text().split())
        except (OSError, ValueError):
            return False
        quiet = 0 if busy else quiet + 1
        if quiet >= 3:
            return True
        time.sleep(0.01)
    return False


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _cached_pages(path: Path) -> int | None:
    """How many of the file's pages are in the page cache (mincore on an untouched private
    mapping, which faults nothing in), or None where that cannot be asked."""
    try:
        import ctypes
        import mmap
        size = path.stat().st_size
        if size == 0:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            anchor = ctypes.c_char.from_buffer(mm)
            try:
                vec = (ctypes.c_ubyte * pages)()
                rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
                return None if rc != 0 else sum(b & 1 for b in vec)
            finally:
                del anchor
    except (OSError, AttributeError, ValueError, TypeError):
        return None


def evict(path: Path) -> bool:
    """Drop the (clean, fsynced) pages of `path`'s files from the page cache; True if confirmed."""
    ok = True
    for p in _files(path):
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)  # already durable: only makes sure no page is left dirty
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            ok = False
        finally:
            os.close(fd)
        ok = ok and _cached_pages(p) == 0
    return ok


def _read_through(path: Path) -> None:
    buf = bytearray(_READ_CHUNK)
    for p in _files(path):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    mem = None
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "memory_gib": round(mem / (1 << 30), 1) if mem else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "kernel": platform.release()}


# -- peak memory, measured in a child process ------------------------------------------------
