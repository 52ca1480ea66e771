"""`python -m resume_conformance.reference COMMAND`: tools for checkpoint directories written by this library.

    python -m resume_conformance.reference fsck DIR     verify every checkpoint in DIR (exit 0/1/2/3, see --help)
    python -m resume_conformance.reference fsck --gc DIR   list orphan pieces of chained checkpoints (--no-dry-run removes)
    python -m resume_conformance.reference log DIR      the checkpoints as a lineage DAG (--format dot, --cold URL)
"""
from __future__ import annotations

import argparse
import sys

from .cli import fsck, log


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m resume_conformance.reference",
                                  description="Tools for checkpoint directories written by the reference library.")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    fsck.add_parser(sub)
    log.add_parser(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = parser()
    try:
        args = top.parse_args(argv)
    except SystemExit as exc:   # argparse: 0 after --help, 2 on a usage error
        return 0 if exc.code in (0, None) else 2
    if args.command is None:
        top.print_usage(sys.stderr)
        print("python -m resume_conformance.reference: error: give a COMMAND (see --help)", file=sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
