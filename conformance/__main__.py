"""Command line.

    python -m conformance replay --adapter=pkg.mod:ADAPTER --check=no_lost_work[inside_save] \
        --total-steps=14 --save-every=3 --seed=0 --schedule=fs:7      # one case, from a failure message
    python -m conformance report conformance-report/report.json       # re-render a saved report
    python -m conformance report --merge shard-1 shard-2 --out merged  # one report from a campaign's shards
    python -m conformance soak --runs 5                                # the ci profile N times ("no crying wolf")
    python -m conformance soak --runs 20 --random --seed 7 --load 2    # fresh seeded draws, under CPU load
    python -m conformance badge conformance-report/report.json         # SVG: the highest conformance level met
    python -m conformance init --framework plain                       # adapter, CI workflow, config; one green run
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _replay(args) -> int:
    from .checks import Session, split_id
    from .checks.failures import CheckNotApplicable, ConformanceFailure
    from .faults.scenario import CrashNotLanded, CrashPointMissing
    from .model.adapters import AdapterError, resolve
    from .model.process import RunSpec
    try:
        check, param = split_id(args.check)
    except KeyError:
        print(f"error: unknown check id {args.check!r}", file=sys.stderr)
        return 2
    case = None
    if check.case is not None:
        text = getattr(args, check.case.name)
        if text is None and check.case.required:
            print(f"error: --{check.case.name} is required for {check.id}", file=sys.stderr)
            return 2
        case = check.case.parse(text) if text is not None else None
    try:
        adapter = resolve(args.adapter, args.trainer_cmd, world_size=args.world_size, nnodes=args.nnodes,
                          capabilities=args.capabilities, carry_env=args.carry_env)
    except AdapterError as exc:
        print(f"error: cannot use the trainer: {exc}", file=sys.stderr)
        return 2
    for name in ("process_timeout", "grace_seconds", "hang_timeout", "loss_tol"):
        value = getattr(args, name)
        if value is not None and not (value > 0 or (name == "loss_tol" and value == 0)):
            print(f"error: --{name.replace('_', '-')} {value:g} is not {'0 or more' if name == 'loss_tol' else 'positive'}",
                  file=sys.stderr)
            return 2
    cold = args.cold_url or "file"
    if cold != "file" and not cold.startswith("s3://"):
        print(f"error: --cold-url must be 'file' or s3://bucket/prefix, got {cold!r}", file=sys.stderr)
        return 2
    given = {k: v for k, v in (("tol", args.loss_tol), ("grace_s", args.grace_seconds),
                               ("hang_timeout", args.hang_timeout)) if v is not None}
    session = Session(adapter, process_timeout=args.process_timeout, resume_python=args.resume_python, cold=cold,
                      **given)
    spec = RunSpec(args.total_steps, args.save_every, args.seed, adapter.world_size, nnodes=adapter.nnodes,
                   node_local=adapter.has("node_local_storage"),
                   cold=cold if adapter.has("cold_tier") else None)
    s3 = None
    if cold.startswith("s3://") and adapter.has("cold_tier"):
        from .run.coldstore import LoopbackS3
        s3 = LoopbackS3(cold)
    try:
        result = check.decide(session, spec, param, case)
    except (ConformanceFailure, CrashNotLanded) as exc:
        print(f"FAIL\n{exc}")
        return 1
    except (CrashPointMissing, CheckNotApplicable) as exc:
        print(f"NOT APPLICABLE: {exc}")
        return 2
    finally:
        session.close()
        if s3 is not None:
            s3.stop()
    extra = f"; checked {result} state(s)" if isinstance(result, int) else ""
    print(f"PASS [{args.check}]{extra} (work files kept in {session.workdir})")
    return 0


def _report(args) -> int:
    from .report import report
    if args.merge is not None:
        return _merge(args)
    if args.path is None:
        print("error: name a report.json to render, or --merge the reports of a campaign's shards\n"
              "  fix: python -m conformance report conformance-report/report.json", file=sys.stderr)
        return 2
    try:
        loaded = report.load_report(args.path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = report.render_markdown(loaded) if args.format != "json" else json.dumps(loaded.to_json(), indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 1 if loaded.failed else 0


def _merge(args) -> int:
    from .report import merge
    problem = ("--merge writes report.json, summary.md and the badge into a directory: give it --out DIR"
               if not args.out else
               f"{args.path} is given before --merge: every report to merge follows --merge"
               if args.path is not None else
               "--merge writes both formats (report.json and summary.md): --format is for rendering one report"
               if args.format is not None else None)
    if problem is not None:
        print(f"error: {problem}\n  fix: python -m conformance report --merge SHARD_DIR... --out DIR", file=sys.stderr)
        return 2
    try:
        merged = merge.merge_files(args.merge)
        written = merge.write(merged, Path(args.out))
    except merge.MergeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write the merged report to {args.out}: {exc}\n  fix: --out a directory that can be "
              "created and written", file=sys.stderr)
        return 2
    print(merge.describe(merged, written))
    return 1 if merged.failed else 0


def _soak(args) -> int:
    from .cli.soak import main as soak_main
    return soak_main(args)


def build_parser() -> argparse.ArgumentParser:
    from .checks import CHECKS, all_check_ids
    from .cli.soak import add_arguments as add_soak_arguments
    from .model.flags import FLAGS
    parser = argparse.ArgumentParser(prog="python -m conformance")
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="replay one case exactly, from the line a failure printed")
    rp.add_argument("--adapter")
    rp.add_argument("--trainer-cmd")
    rp.add_argument("--world-size", default=None, metavar="W",
                    help="run the trainer as W ranks under torchrun (default: the adapter's world_size, or 1)")
    rp.add_argument("--nnodes", default=None, metavar="N",
                    help="spread the ranks over N torchrun agents ('nodes'; default: the adapter's nnodes, or 1)")
    rp.add_argument("--check", required=True, metavar="ID", help="one of: " + ", ".join(all_check_ids()))
    rp.add_argument("--total-steps", type=int, required=True)
    rp.add_argument("--save-every", type=int, required=True)
    rp.add_argument("--seed", type=int, default=0)
    for option in dict.fromkeys(c.case for c in CHECKS if c.case is not None):
        rp.add_argument(f"--{option.name.replace('_', '-')}", dest=option.name, help=option.help)
    for flag in FLAGS:   # the options a failure's replay line carries (model/flags.py: verdict or replayed)
        if flag.in_replay_line:
            rp.add_argument(flag.short, flag.flag, dest=flag.name, metavar=flag.metavar, help=flag.help,
                            type=float if flag.kind in ("seconds", "tolerance") else None)
    rep = sub.add_parser("report", help="render a saved report.json, or merge a campaign's (exit 1 if it holds "
                         "failures)")
    rep.add_argument("path", nargs="?", help="report.json written by --conformance-report")
    rep.add_argument("--merge", nargs="+", metavar="DIR_OR_JSON",
                     help="join the reports of a campaign's shards into one (a directory: its report.json, or each "
                          "run's of a soak --out directory); writes report.json, summary.md and the badge to --out")
    rep.add_argument("--format", choices=("markdown", "json"), default=None, help="default markdown")
    rep.add_argument("--out", help="write here instead of stdout (with --merge: the directory to write to)")
    so = sub.add_parser("soak", help="run the gate N times against correct trainers; report any failure")
    add_soak_arguments(so)
    ba = sub.add_parser("badge", help="write an SVG badge stating the highest conformance level a report meets")
    ba.add_argument("path", help="report.json written by --conformance-report")
    ba.add_argument("--out", default="conformance-badge.svg", help="where to write the SVG")
    it = sub.add_parser("init", help="write an adapter, a CI workflow and config for a framework, then one green run")
    it.add_argument("--framework", choices=("plain", "lightning", "accelerate", "hf"), default="plain")
    it.add_argument("--dir", default=".", help="the repository to write into")
    it.add_argument("--force", action="store_true", help="overwrite files that exist")
    it.add_argument("--no-run", action="store_true", help="do not run the quick profile afterwards")
    return parser


def _badge(args) -> int:
    from .report import report
    from .report.levels import badge_svg, highest
    try:
        loaded = report.load_report(args.path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    levels = loaded.levels()
    Path(args.out).write_text(badge_svg(levels))
    top = highest(levels)
    print(f"{args.out}: {top.level + ' ' + top.meaning if top else 'no level met'} "
          f"({', '.join(f'{s.level} {s.status}' for s in levels)})")
    return 0


def _init(args) -> int:
    from .cli.init import main as init_main
    return init_main(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"soak": _soak, "replay": _replay, "report": _report, "badge": _badge, "init": _init}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
