"""Where trainer processes keep their checkpoint directories during a session: the session's work
directory (the default), a directory named by CONFORMANCE_SCRATCH, or tmpfs.

Kept apart from session.py, which only asks once per session: the filesystem under a trainer can
change what it does (a "move" between two filesystems is a copy written in place), so where its
directories live is a choice of its own, documented with the option (docs/running.md)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

# `auto` takes tmpfs only when it has this much free (2 GiB, as docs/running.md says).
SCRATCH_MIN_FREE = 2 << 30


def scratch_root(workdir: Path) -> Path:
    """Where trainer processes keep their checkpoint directories during a session.

    CONFORMANCE_SCRATCH=workdir (default): the session's work directory. A path: a directory
    under it. `auto`: tmpfs (/dev/shm) when it has at least SCRATCH_MIN_FREE bytes free. Not the
    default, because the filesystem can change what a trainer does: Lightning's temp file lives in
    the system temp directory, and when the checkpoint directory is on another filesystem its
    "atomic" move becomes an in-place copy."""
    choice = os.environ.get("CONFORMANCE_SCRATCH", "workdir")
    if choice == "workdir":
        return workdir
    if choice != "auto":
        path = Path(choice)
        path.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="conformance-", dir=path))
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize >= SCRATCH_MIN_FREE and os.access(shm, os.W_OK):
            return Path(tempfile.mkdtemp(prefix="conformance-", dir=shm))
    except OSError:
        pass
    return workdir
