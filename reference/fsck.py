"""`python -m reference fsck DIR`: verify every checkpoint in a directory, one row each.

Exit status: 0 all valid, 1 any corrupt or incomplete, 2 usage error.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .atomic import is_temp_name
from .errors import CheckpointError, IncompleteCheckpointError
from .manager import list_checkpoints, load


def scan(directory: Path) -> list[tuple[str, str, str, str]]:
    rows = []
    for info in list_checkpoints(directory):
        try:
            load(info.path, map_location="cpu")
            rows.append((info.path.name, str(info.step), "valid", ""))
        except IncompleteCheckpointError as exc:
            rows.append((info.path.name, str(info.step), "incomplete", str(exc)))
        except CheckpointError as exc:
            rows.append((info.path.name, str(info.step), "corrupt", f"{type(exc).__name__}: {exc}"))
    for entry in sorted(directory.iterdir()):
        if is_temp_name(entry.name):
            rows.append((entry.name, "-", "temp", "left by an interrupted save; removed on next save"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference fsck",
                                     description="Verify every checkpoint in DIR.")
    parser.add_argument("directory", type=Path)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    if not args.directory.is_dir():
        print(f"fsck: {args.directory}: not a directory", file=sys.stderr)
        return 2
    rows = scan(args.directory)
    header = ("name", "step", "status", "reason")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
    checkpoints = [r for r in rows if r[2] != "temp"]
    if not checkpoints:
        print(f"fsck: no checkpoints in {args.directory}", file=sys.stderr)
    return 1 if any(r[2] in ("corrupt", "incomplete") for r in rows) else 0
