"""`python -m resume_conformance.reference.bench`: options, priority, the work directory."""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from conformance.report.readme import replace_section

from .constants import _MARKER, MIN_ROUNDS
from .disk import fs_type
from .memory import _memory_child
from .output import format_markdown, format_table
from .run import run_benchmark


def set_priority(nice: int) -> str:
    """Apply `nice` to this process and, where the kernel groups processes by session (autogroup,
    which makes plain nice values matter only within a session), to its autogroup. The autogroup
    setting outlives the process, so the previous value is put back at exit."""
    done = []
    try:
        os.nice(nice - os.nice(0))
        done.append(f"nice {os.nice(0)}")
    except OSError as exc:
        done.append(f"nice unchanged ({exc.strerror})")
    try:
        with open("/proc/self/autogroup") as f:
            previous = int(f.read().split("nice")[1])
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
        done.append(f"autogroup nice {nice}")
    except (OSError, IndexError, ValueError):
        return ", ".join(done)

    def restore() -> None:
        with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
            f.write(str(previous))

    atexit.register(restore)
    return ", ".join(done)


def _default_parent() -> Path:
    return Path.cwd()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m resume_conformance.reference.bench",
                                     description=_package_doc().split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024,
                        help="state size in MiB (default 1024: every sample takes >= 0.5 s here)")
    parser.add_argument("--repeats", type=int, default=MIN_ROUNDS,
                        help=f"rounds, the variants interleaved in each; fewer than {MIN_ROUNDS} leaves every "
                             f"timed ratio inconclusive (default {MIN_ROUNDS})")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (a temp dir is made inside it and removed afterwards; "
                             "default: the current directory, so its disk is measured, not a tmpfs)")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--no-chains", action="store_true",
                        help="skip the chained-checkpoint keys (incremental, compression, async; see chains.py)")
    parser.add_argument("--nice", type=int, default=0, metavar="N",
                        help="run at this nice value, and (Linux, root) with this autogroup nice, so "
                             "other sessions' processes take less of the CPUs; negative raises the "
                             "priority (default 0: unchanged). Reported in the output.")
    parser.add_argument("--markdown", action="store_true", help="also print the README section")
    parser.add_argument("--update-readme", type=Path, default=None, metavar="README",
                        help=f"replace the section after the {_MARKER} line of this Markdown page "
                             "(docs/benchmarks.md) with the table")
    parser.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.size_mb <= 0:
        parser.error("--repeats must be >= 1 and --size-mb > 0")

    priority = set_priority(args.nice) if args.nice else "unchanged"
    if args.memory_child:
        print(json.dumps(_memory_child(args.memory_child, args.size_mb, args.dir)))
        return 0

    parent = args.dir if args.dir is not None else _default_parent()
    parent.mkdir(parents=True, exist_ok=True)
    kind = fs_type(parent)
    if kind in ("tmpfs", "ramfs"):
        print(f"warning: {parent} is on {kind}; the numbers measure memory, not a disk", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix=".reference-bench-", dir=parent))
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        result = run_benchmark(args.size_mb, args.repeats, work, memory=not args.no_memory,
                               chains=not args.no_chains, log=log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "python -m resume_conformance.reference.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    result["command"] = command.strip()
    result["priority"] = priority
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    if args.markdown:
        print(format_markdown(result, result["command"]), file=sys.stderr if args.json else sys.stdout)
    if args.update_readme is not None:
        replace_section(Path(args.update_readme), _MARKER, format_markdown(result, result["command"]))
    return 0




def _package_doc() -> str:
    from . import __doc__ as doc
    return doc or ""
