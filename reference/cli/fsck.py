"""`python -m resume_conformance.reference fsck DIR`: verify every checkpoint in a directory, one row each.

Chained checkpoints are loaded through their whole chain (a missing or replaced parent is
"broken-chain"), and pieces of the store that no manifest lists are "orphan" rows. `--gc` lists
the orphans it would remove (a dry run); `--gc --no-dry-run` removes those older than
`--min-age` seconds (default 600, so that a save in progress, whose pieces are not yet listed by
its manifest, is left alone).

Exit status: 0 every checkpoint valid; 1 any corrupt, incomplete or broken; 2 usage error; 3 no
checkpoint of this library found (an empty directory, or another library's files), so a CI step
gating on it never passes by accident. Orphans alone do not fail it: they waste space only.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..chain import gc
from ..chain import read as chain
from ..errors import CheckpointError, IncompleteCheckpointError
from ..manager import list_checkpoints, load
from ..primitives.atomic import is_temp_name

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_NOTHING = 0, 1, 2, 3


def scan(directory: Path) -> list[tuple[str, str, str, str]]:
    rows = []
    for info in list_checkpoints(directory):
        try:
            load(info.path, map_location="cpu")
            rows.append((info.path.name, str(info.step), "valid", ""))
        except chain.BrokenChainError as exc:
            rows.append((info.path.name, str(info.step), "broken-chain", str(exc)))
        except IncompleteCheckpointError as exc:
            rows.append((info.path.name, str(info.step), "incomplete", str(exc)))
        except CheckpointError as exc:
            rows.append((info.path.name, str(info.step), "corrupt", f"{type(exc).__name__}: {exc}"))
    for entry in sorted(directory.iterdir()):
        if is_temp_name(entry.name):
            rows.append((entry.name, "-", "temp", "left by an interrupted save; removed on next save"))
    for path in gc.orphans(directory)[0]:
        rows.append((f"{chain.PIECES}/{path.name}", "-", "orphan",
                     f"{path.stat().st_size} bytes no manifest lists; "
                     "python -m resume_conformance.reference fsck --gc removes it"))
    return rows


def collect_garbage(directory: Path, *, dry_run: bool, min_age: float) -> int:
    """Print (and unless `dry_run`, remove) the orphan pieces older than `min_age` seconds."""
    now, count, size = time.time(), 0, 0
    for path in gc.orphans(directory)[0]:
        st = path.stat()
        if now - st.st_mtime < min_age:
            print(f"keep   {chain.PIECES}/{path.name} (younger than {min_age:g} s: a save may be writing it)")
            continue
        if not dry_run:
            path.unlink(missing_ok=True)
        count, size = count + 1, size + st.st_size
        print(f"{'would remove' if dry_run else 'removed'} {chain.PIECES}/{path.name} ({st.st_size} bytes)")
    fate = "would be removed (dry run; --no-dry-run removes)" if dry_run else "removed"
    print(f"gc: {count} orphan piece(s), {size} bytes {fate}")
    return EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("fsck", help="verify every checkpoint in DIR",
                       description="Verify every checkpoint in DIR: one row each (name, step, status, reason). "
                                   "Exit 0 all valid, 1 any corrupt or incomplete, 2 usage error, 3 no checkpoint "
                                   "of this library found.")
    p.add_argument("directory", type=Path, metavar="DIR")
    p.add_argument("--gc", action="store_true", help="list the orphan pieces of chained checkpoints to remove")
    p.add_argument("--dry-run", action=argparse.BooleanOptionalAction, default=True,
                   help="with --gc: only list (default); --no-dry-run removes")
    p.add_argument("--min-age", type=float, default=600.0, metavar="SECONDS",
                   help="with --gc: leave orphans younger than this (a save in progress), default 600")
    p.set_defaults(run=run)


def run(args) -> int:
    directory: Path = args.directory
    if not directory.is_dir():
        print(f"fsck: {directory}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    if args.gc:
        return collect_garbage(directory, dry_run=args.dry_run, min_age=args.min_age)
    rows = scan(directory)
    checkpoints = [r for r in rows if r[2] not in ("temp", "orphan")]
    if checkpoints:
        header = ("name", "step", "status", "reason")
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
        for row in [header] + rows:
            print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
        return EXIT_BAD if any(r[2] in ("corrupt", "incomplete", "broken-chain") for r in rows) else EXIT_OK
    others = [e.name for e in sorted(directory.iterdir()) if not is_temp_name(e.name)]
    what = ("it is empty" if not others and not rows else
            f"it holds {len(others)} entr{'y' if len(others) == 1 else 'ies'} this library does not recognize: "
            + ", ".join(others[:5]) + (" ..." if len(others) > 5 else "") if others else
            f"it holds only {len(rows)} temp file(s) of interrupted saves")
    print(f"fsck: no checkpoints of this library found in {directory} ({what})", file=sys.stderr)
    return EXIT_NOTHING
