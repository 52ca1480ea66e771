"""Command line.

    python -m conformance replay --adapter=pkg.mod:ADAPTER --check=no_lost_work \
        --total-steps=14 --save-every=3 --seed=0 --schedule=fs:7      # one case, from a failure message
    python -m conformance report conformance-report/report.json       # re-render a saved report
    python -m conformance soak --runs 5                                # the ci profile N times ("no crying wolf")
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import checks
from .adapters import resolve
from .corrupt import KINDS
from .crash import parse_schedule
from .judge import ConformanceFailure
from .scenario import CrashNotLanded, CrashPointMissing
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
        elif args.check == "crash_states":
            n = checks.check_crash_states(session, spec, only=args.state)
            print(f"checked {n} crash state(s)")
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
    except CrashPointMissing as exc:
        print(f"NOT APPLICABLE: {exc}")
        return 2
    print(f"PASS [{args.check}] (work files kept in {session.workdir})")
    return 0


def _report(args) -> int:
    from . import report
    try:
        loaded = report.load_report(args.path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = report.render_markdown(loaded) if args.format == "markdown" else json.dumps(loaded, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    bad = loaded.get("counts", {})
    return 1 if bad.get("failed") or bad.get("error") else 0


def _soak(args) -> int:
    """Run the gate (`ci` profile) N times per correct trainer; any failure is a flaky check."""
    import subprocess
    import tempfile
    import time

    from . import report
    adapters = args.adapter or _default_correct_trainers()
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="conformance-soak-"))
    failures: list[str] = []
    rows = []
    for spec in adapters:
        for i in range(1, args.runs + 1):
            run_dir = out_dir / f"{spec.replace(':', '.').replace('/', '_')}-run{i}"
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-q",
                   f"--adapter={spec}", f"--hypothesis-profile={args.profile}", f"--conformance-report={run_dir}",
                   f"--basetemp={run_dir / 'tmp'}", *(["-n", args.workers] if args.workers != "0" else [])]
            start = time.monotonic()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            seconds = time.monotonic() - start
            try:
                loaded = report.load_report(run_dir / "report.json")
                bad = [c for c in loaded["cases"] if c["outcome"] in ("failed", "error")]
                counts = loaded["counts"]
            except ValueError as exc:
                output = (proc.stdout + proc.stderr).strip().splitlines()
                bad, counts = [{"check": "(no report)", "message": f"pytest exited {proc.returncode}: "
                                f"{output[-1] if output else ''} ({exc})"}], {}
            for case in bad:
                first = (case.get("message") or "").strip().splitlines()
                failures.append(f"{spec} run {i}: {case['check']}: {first[0] if first else ''}")
            rows.append((spec, i, seconds, counts, len(bad)))
            print(f"{spec} run {i}/{args.runs}: {len(bad)} failure(s), {counts} in {seconds:.0f}s", flush=True)
    total = len(rows)
    print(f"\nsoak: {total} run(s) of the '{args.profile}' profile against {len(adapters)} trainer(s); "
          f"{sum(r[4] > 0 for r in rows)} run(s) with failures. Reports under {out_dir}")
    for line in failures:
        print(f"  FAIL {line}")
    return 1 if failures else 0


def _default_correct_trainers() -> list[str]:
    from fixtures import CORRECT_TRAINERS
    return list(CORRECT_TRAINERS)


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
    rp.add_argument("--state", help="crash_states: one state label, e.g. 37 or 37t")
    rp.add_argument("--loss-tol", type=float, default=checks.DEFAULT_TOL)
    rep = sub.add_parser("report", help="render a saved report.json (exit 1 if it holds failures)")
    rep.add_argument("path", help="report.json written by --conformance-report")
    rep.add_argument("--format", choices=("markdown", "json"), default="markdown")
    rep.add_argument("--out", help="write here instead of stdout")
    so = sub.add_parser("soak", help="run the gate N times against correct trainers; report any failure")
    so.add_argument("--runs", type=int, default=3)
    so.add_argument("--adapter", action="append", help="adapter to soak (repeatable); default: the "
                    "project's correct trainers")
    so.add_argument("--profile", default="ci")
    so.add_argument("--workers", default="auto", help="pytest-xdist -n value ('0' for none)")
    so.add_argument("--out", help="directory for the runs' reports")
    args = parser.parse_args(argv)
    if args.command == "soak":
        return _soak(args)
    if args.command == "replay":
        return _replay(args)
    if args.command == "report":
        return _report(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
