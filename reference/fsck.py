"""`python -m reference fsck DIR`: verify every checkpoint in a directory, one row each.

Exit status: 0 every checkpoint valid; 1 any corrupt or incomplete; 2 usage error; 3 no
checkpoint of this library found (an empty directory, or another library's files), so a CI step
gating on it never passes by accident.
"""
from __future__ import annotations

import sys
from pathlib import Path

from .atomic import is_temp_name
from .errors import CheckpointError, IncompleteCheckpointError
from .manager import list_checkpoints, load

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_NOTHING = 0, 1, 2, 3


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


def add_parser(sub) -> None:
    p = sub.add_parser("fsck", help="verify every checkpoint in DIR",
                       description="Verify every checkpoint in DIR: one row each (name, step, status, reason). "
                                   "Exit 0 all valid, 1 any corrupt or incomplete, 2 usage error, 3 no checkpoint "
                                   "of this library found.")
    p.add_argument("directory", type=Path, metavar="DIR")
    p.set_defaults(run=run)


def run(args) -> int:
    directory: Path = args.directory
    if not directory.is_dir():
        print(f"fsck: {directory}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    rows = scan(directory)
    checkpoints = [r for r in rows if r[2] != "temp"]
    if checkpoints:
        header = ("name", "step", "status", "reason")
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
        for row in [header] + rows:
            print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
        return EXIT_BAD if any(r[2] in ("corrupt", "incomplete") for r in rows) else EXIT_OK
    others = [e.name for e in sorted(directory.iterdir()) if not is_temp_name(e.name)]
    what = ("it is empty" if not others and not rows else
            f"it holds {len(others)} entr{'y' if len(others) == 1 else 'ies'} this library does not recognize: "
            + ", ".join(others[:5]) + (" ..." if len(others) > 5 else "") if others else
            f"it holds only {len(rows)} temp file(s) of interrupted saves")
    print(f"fsck: no checkpoints of this library found in {directory} ({what})", file=sys.stderr)
    return EXIT_NOTHING


def main(argv: list[str] | None = None) -> int:
    from .__main__ import main as cli
    return cli(["fsck", *(argv or [])])
