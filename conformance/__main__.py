"""Command line: `python -m conformance replay ...` replays one case from a failure message.

    python -m conformance replay --adapter=pkg.mod:ADAPTER --check=no_lost_work \
        --total-steps=12 --save-every=3 --seed=0 --schedule=fs:7
"""
from __future__ import annotations

import argparse
import sys

from . import checks
from .adapters import resolve
from .corrupt import KINDS
from .crash import parse_schedule
from .judge import ConformanceFailure
from .scenario import CrashNotLanded
from .trials import RunSpec


def _replay(args) -> int:
    adapter = resolve(args.adapter, args.trainer_cmd)
    session = checks.Session(adapter, tol=args.loss_tol)
    spec = RunSpec(args.total_steps, args.save_every, args.seed)
    try:
        if args.check == "determinism_precondition":
            checks.check_determinism(session, spec)
        elif args.check in checks.JUDGES:
            if args.schedule is None:
                raise SystemExit("--schedule is required for this check")
            checks.check_schedule(session, args.check, spec, parse_schedule(args.schedule))
        elif args.check == "corruption_detected":
            if args.corruption not in KINDS:
                raise SystemExit(f"--corruption must be one of {KINDS}")
            checks.check_corruption(session, spec, args.corruption)
        elif args.check == "untrusted_checkpoint":
            checks.check_untrusted(session, spec)
        elif args.check == "schema_migration":
            samples = [s for s in adapter.legacy_samples if args.legacy in (None, s.name)]
            if not samples:
                raise SystemExit(f"adapter has no legacy sample named {args.legacy!r}")
            for sample in samples:
                checks.check_legacy_sample(session, spec, sample)
    except (ConformanceFailure, CrashNotLanded) as exc:
        print(f"FAIL\n{exc}")
        return 1
    print(f"PASS [{args.check}] (work files kept in {session.workdir})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance")
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="replay one case exactly, from the line a failure printed")
    rp.add_argument("--adapter")
    rp.add_argument("--trainer-cmd")
    rp.add_argument("--check", required=True, choices=checks.CHECK_IDS)
    rp.add_argument("--total-steps", type=int, required=True)
    rp.add_argument("--save-every", type=int, required=True)
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--schedule")
    rp.add_argument("--corruption")
    rp.add_argument("--legacy")
    rp.add_argument("--loss-tol", type=float, default=checks.DEFAULT_TOL)
    args = parser.parse_args(argv)
    if args.command == "replay":
        return _replay(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
