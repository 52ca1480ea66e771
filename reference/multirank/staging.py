"""The staging directory of a multi-rank save (`.staging-step-N`, names.staging_name): made empty before
the save writes into it, renamed to `step-N` by the commit, and swept once a later step has committed.
The one place both multi-rank managers (reference.distributed, multirank.replicated) make and sweep them.

What stands under a staging name is removed whatever it is: a directory with all it holds, a stray
file or a link unlinked (never followed), so a sweep neither fails on one nor reaches outside the run
directory through it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from .. import names


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def fresh_staging(staging: Path) -> None:
    """Make `staging` an empty directory: what a save of its step that died left there goes first."""
    if os.path.lexists(staging):
        _remove(staging)
    staging.mkdir(parents=True)


def sweep_staging(directory: Path, *, older_than: int | None = None) -> list[Path]:
    """Remove the staging entries of `directory` (of steps before `older_than`, or all): the ones
    removed. One that cannot be removed stays, is not reported, and fails nothing (the step that
    asked has committed)."""
    removed = []
    for entry in os.scandir(directory):
        step = names.staging_step(entry.name)
        if step is None or (older_than is not None and step >= older_than):
            continue
        with contextlib.suppress(OSError):
            _remove(Path(entry.path))
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    return removed
