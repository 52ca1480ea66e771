"""`python -m conformance soak`: run the gate N times against correct trainers; any failure is a
flaky check ("no crying wolf").

    python -m conformance soak --runs 5                                  # ci, every correct trainer
    python -m conformance soak --runs 20 --random --seed 7 --load 2     # fresh draws, under CPU load

With `--random`, run i draws with `--hypothesis-seed=<run_seed(campaign seed, i)>` under the
profile's `-random` variant (registered here: the profile without derandomize and without an
example database). The suite fixes the seed of the `quick` and `ci` profiles by name
(settings.SEEDED_PROFILES), which overrides `--hypothesis-seed`; the variant's name is not in
that table, so the seed decides the draws. The pytest command loads this module as a plugin
(`-p conformance.cli.soak`) so that the variant exists there; that is also in every replay line.

A campaign spread over N machines: each runs `--random --seed S --shard i/N` with the same S; its
run k is the campaign's run (k-1)*N + i, so the machines' draws never repeat each other, and every
failure's replay line carries its own --hypothesis-seed.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hypothesis import settings as _hypothesis_settings

from ..model.evidence import Intermittent
from ..model.settings import EXAMPLE_DB_PROBLEM, GATE_PROFILE, OLD_PROFILE_NAMES, PROFILES, SEEDED_PROFILES
from .load import Burners, load_text

DEFAULT_SOAK = "resume_conformance.fixtures:CORRECT_TRAINERS"   # adapter specs of the project's correct trainers
RANDOM_SUFFIX = "-random"
PLUGIN = "conformance.cli.soak"   # `-p` this module: registers the `-random` profiles in the pytest process
USAGE = "python -m conformance soak: error: "

for _name in PROFILES:
    _hypothesis_settings.register_profile(_name + RANDOM_SUFFIX, parent=_hypothesis_settings.get_profile(_name),
                                          derandomize=False, database=None)


class SoakUsageError(ValueError):
    pass


class TrainerUnloadable(SoakUsageError):
    """Its module raised ImportError (e.g. an extra not installed; the AdapterError's context); `reason`: its text."""
    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = " ".join(reason.split()) or message


@dataclasses.dataclass(frozen=True)
class Trainer:
    """One soaked trainer: an adapter spec or a trainer command (one row of the table)."""
    adapter: str | None = None
    trainer_cmd: str | None = None

    @property
    def label(self) -> str:
        return self.adapter if self.adapter is not None else f"cmd:{self.trainer_cmd}"

    def options(self) -> list[str]:
        # The namespaced spellings: a run's environment may hold a plugin that owns --adapter.
        return [f"--conformance-adapter={self.adapter}"] if self.adapter is not None else \
            [f"--conformance-trainer-cmd={self.trainer_cmd}"]


def _at_least(lowest: int):
    """An argparse type: a whole number >= `lowest`."""
    def parse(text: str) -> int:
        value = _integer(text)
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {text!r}")
        return value
    return parse


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"must be i/N with 1 <= i <= N (e.g. 2/8), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _workers(text: str) -> str:
    if text in ("auto", "logical") or (text.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"must be 'auto', 'logical' or a number >= 0 (0: no xdist), got {text!r}")


def add_arguments(so: argparse.ArgumentParser) -> None:
    so.add_argument("--runs", type=_at_least(1), default=3, help="runs per trainer (default 3)")
    so.add_argument("--adapter", action="append", dest="trainers", type=lambda s: Trainer(adapter=s),
                    metavar="SPEC", help="adapter to soak (repeatable; with --trainer-cmd, each is one trainer); "
                    "default: the project's correct trainers")
    so.add_argument("--trainer-cmd", action="append", dest="trainers", type=lambda s: Trainer(trainer_cmd=s),
                    metavar="CMD", help="command that starts a trainer following the command contract (repeatable)")
    so.add_argument("--world-size", default=None, metavar="W",
                    help="run the trainers as W ranks under torchrun (default: each adapter's world_size, or 1)")
    so.add_argument("--nnodes", default=None, metavar="N",
                    help="spread the ranks over N torchrun agents ('nodes'; default: each adapter's nnodes, or 1)")
    so.add_argument("--profile", default=GATE_PROFILE, type=lambda name: OLD_PROFILE_NAMES.get(name, name),
                    help=f"Hypothesis profile (default {GATE_PROFILE}; the short names quick, ci, fuzz work too)")
    so.add_argument("--random", action="store_true",
                    help="fresh draws each run (the profile's '-random' variant and --hypothesis-seed) instead of "
                         "the profile's fixed ones; each run's seed is printed")
    so.add_argument("--seed", type=_integer, default=None, metavar="N",
                    help="campaign seed for --random: run i draws with a seed derived from N (default: a new one, "
                         "printed); the same --seed replays the same campaign")
    so.add_argument("--load", type=_at_least(0), default=0, metavar="N",
                    help="run N CPU burner processes beside the runs (CI-like load)")
    so.add_argument("--workers", type=_workers, default="auto", help="pytest-xdist -n value ('0' for none)")
    so.add_argument("--out", help="directory for the runs' reports (default: a new temporary directory)")
    so.add_argument("--shard", type=_shard, default=None, metavar="i/N",
                    help="this machine's slice of a --random campaign spread over N machines (1 <= i <= N): its "
                         "run k is the campaign's run (k-1)*N+i; every machine gives the same --seed")
    so.add_argument("--select", default=None, metavar="EXPR",
                    help="only the checks pytest's -k EXPR selects (e.g. 'interrupt or hang'); default: every check")


def run_seed(campaign: int, run: int) -> int:
    """The --hypothesis-seed of run `run` (1-based) of a --random campaign: a pure function of both."""
    digest = hashlib.sha256(f"conformance-soak:{campaign}:{run}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def build_command(trainer: Trainer, *, profile: str, seed: int | None = None, world_size: str | None = None,
                  workers: str = "0", report_dir: Path | None = None, basetemp: Path | None = None,
                  select: str | None = None, python: str = sys.executable, nnodes: str | None = None) -> list[str]:
    """The pytest command of one run (`seed`: a --random run, under `profile`'s -random variant)."""
    profile = OLD_PROFILE_NAMES.get(profile, profile)
    cmd = [python, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-q"]
    if seed is not None:
        cmd += ["-p", PLUGIN]
    cmd += trainer.options()
    cmd += [f"--conformance-world-size={world_size}"] if world_size is not None else []
    cmd += [f"--conformance-nnodes={nnodes}"] if nnodes is not None else []
    cmd.append(f"--hypothesis-profile={profile + RANDOM_SUFFIX if seed is not None else profile}")
    if seed is not None:
        cmd.append(f"--hypothesis-seed={seed}")
    cmd += ["-k", select] if select else []
    cmd += [f"--conformance-report={report_dir}"] if report_dir is not None else []
    cmd += [f"--basetemp={basetemp}"] if basetemp is not None else []
    cmd += ["-n", workers] if workers != "0" else []
    return cmd


@dataclasses.dataclass(frozen=True)
class Plan:
    trainers: tuple[Trainer, ...]
    runs: int
    profile: str
    random: bool
    campaign_seed: int | None
    world_size: str | None
    workers: str
    load: int
    out_dir: Path
    select: str | None = None    # pytest -k: only these checks (e.g. the ones a change touched)
    shard: tuple[int, int] | None = None   # (i, N): this machine's slice of a campaign over N machines
    nnodes: str | None = None
    skipped: tuple[tuple[str, str], ...] = ()   # (label, why): default trainers that cannot be loaded here

    def campaign_run(self, run: int) -> int:
        """The campaign's number for this machine's run `run` (1-based)."""
        return run if self.shard is None else (run - 1) * self.shard[1] + self.shard[0]

    def seed(self, run: int) -> int | None:
        return run_seed(self.campaign_seed, self.campaign_run(run)) if self.random else None

    def seed_text(self, run: int) -> str:
        if self.random:
            return str(self.seed(run))
        fixed = SEEDED_PROFILES.get(self.profile)
        return f"{fixed} (fixed)" if fixed is not None else "unseeded"

    def command(self, trainer: Trainer, run: int, **extra) -> list[str]:
        extra.setdefault("select", self.select)
        return build_command(trainer, profile=self.profile, seed=self.seed(run), world_size=self.world_size,
                             workers=self.workers, nnodes=self.nnodes, **extra)


def plan(args, *, check_trainer: Callable[[Trainer, str | None], None] | None = None) -> Plan:
    """The campaign the options describe, or SoakUsageError saying what is wrong with them."""
    if args.runs < 1:
        raise SoakUsageError(f"--runs must be >= 1, got {args.runs}")
    if args.load < 0:
        raise SoakUsageError(f"--load must be >= 0, got {args.load}")
    if EXAMPLE_DB_PROBLEM:   # every run's pytest would stop with it
        raise SoakUsageError(EXAMPLE_DB_PROBLEM)
    if args.random and args.profile not in PROFILES:
        raise SoakUsageError(f"--random needs one of the suite's profiles ({', '.join(PROFILES)}), "
                             f"got --profile={args.profile!r}")
    shard = args.shard
    if shard is not None and (not args.random or args.seed is None):
        raise SoakUsageError("--shard splits one --random campaign over machines: give every machine --random and "
                             "the same --seed N (without them each machine would draw the same or unrelated runs)")
    if args.seed is not None and not args.random:
        raise SoakUsageError("--seed sets the draws of a --random campaign; add --random "
                             f"(without it, the '{args.profile}' profile's own draws are used)")
    trainers = tuple(dict.fromkeys(args.trainers or ()))
    if not trainers:
        from ..model.adapters import AdapterError, load_object
        try:
            trainers = tuple(Trainer(adapter=spec) for spec in load_object(DEFAULT_SOAK))
        except AdapterError as exc:
            raise SoakUsageError(f"cannot load the default trainers: {exc}") from None
    nnodes = getattr(args, "nnodes", None)
    check = check_trainer or (lambda trainer, world_size: _check_trainer(trainer, world_size, nnodes))
    skipped = {}   # label: why, for default trainers that cannot be loaded here (e.g. an extra not installed)
    for trainer in trainers:
        try:
            check(trainer, args.world_size)
        except TrainerUnloadable as exc:
            if args.trainers:   # a trainer the user named: a usage error, as for any other problem with it
                raise
            skipped[trainer.label] = exc.reason
    if len(skipped) == len(trainers):
        raise SoakUsageError(f"none of the default trainers ({DEFAULT_SOAK}) can be loaded here:"
                             + "".join(f"\n  {label}: {reason}" for label, reason in skipped.items()))
    campaign_seed = args.seed if args.seed is not None else (secrets.randbits(32) if args.random else None)
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="conformance-soak-"))
    return Plan(tuple(t for t in trainers if t.label not in skipped), args.runs, args.profile, args.random, campaign_seed,
                args.world_size, args.workers, args.load, out_dir, args.select, shard, nnodes, tuple(skipped.items()))


def _check_trainer(trainer: Trainer, world_size: str | None, nnodes: str | None = None) -> None:
    from ..model.adapters import AdapterError, resolve
    if not (trainer.adapter if trainer.adapter is not None else trainer.trainer_cmd or "").strip():
        # an empty value would name no trainer, and the suite would test its bundled one instead
        raise SoakUsageError(f"{'--adapter' if trainer.adapter is not None else '--trainer-cmd'} is empty; "
                             "name a trainer, or leave the option out to soak the project's correct trainers")
    try:
        resolve(trainer.adapter, trainer.trainer_cmd, world_size=world_size, nnodes=nnodes)
    except AdapterError as exc:
        message, cause = f"cannot use the trainer {trainer.label}: {exc}", exc.__cause__ or exc.__context__
        error = TrainerUnloadable(message, str(cause)) if isinstance(cause, ImportError) else SoakUsageError(message)
        raise error from None


@dataclasses.dataclass
class Outcome:
    counts: dict[str, int]
    failures: list[tuple[str, str]]   # (check id, message); check "(no report)" when pytest wrote none
    settled: list[Intermittent] = dataclasses.field(default_factory=list)   # failures replayed in both runners
    disagreements: int = 0            # runner disagreements (each also one of `failures`)

    def settled_text(self) -> str:
        """How the run's failures were settled by repetition, where any were: " (1 intermittent, ...)"."""
        raced = sum(e.reproduced for e in self.settled)
        parts = [f"{raced} intermittent" if raced else "",
                 f"{len(self.settled) - raced} not reproducible" if len(self.settled) > raced else "",
                 f"{self.disagreements} runner disagreement(s)" if self.disagreements else ""]
        shown = ", ".join(p for p in parts if p)
        return f" ({shown})" if shown else ""


def run_pytest(cmd: list[str], run_dir: Path) -> Outcome:
    from ..report import report
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    try:
        loaded = report.load_report(run_dir / "report.json")
    except ValueError as exc:
        output = (proc.stdout + proc.stderr).strip().splitlines()
        return Outcome({}, [("(no report)", f"pytest exited {proc.returncode}: {output[-1] if output else ''} ({exc})")])
    # A runner disagreement (the warm runner failed what a fresh interpreter passed) passes the check
    # but is a flaw of the suite's: a soak counts it as a failure.
    return Outcome(loaded.counts, [(c.check, c.message) for c in loaded.failed]
                   + [(c.check, f"{found.summary()}\n{found.warm}") for c, found in loaded.disagreements],
                   [found for _, found in loaded.intermittent], len(loaded.disagreements))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:60]


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no checks ran"


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def campaign(plan: Plan, run: Callable[[list[str], Path], Outcome] | None = None, out=print) -> int:
    """Every run of the plan, with its burners; prints a line per run, a table and the failures.
    `run(cmd, run_dir)` runs one (default: run_pytest)."""
    run = run or run_pytest
    for label, reason in plan.skipped:
        out(f"soak: skipping {label}: {reason}", flush=True)
    what = (f"the '{plan.profile}{RANDOM_SUFFIX}' profile, campaign seed {plan.campaign_seed} "
            f"(--random --seed {plan.campaign_seed} replays it)" if plan.random else f"the '{plan.profile}' profile")
    if plan.shard is not None:
        what += (f", shard {plan.shard[0]}/{plan.shard[1]} (campaign runs "
                 f"{', '.join(str(plan.campaign_run(k)) for k in range(1, min(plan.runs, 4) + 1))}"
                 f"{', ...' if plan.runs > 4 else ''})")
    out(f"soak: {plan.runs} run(s) x {len(plan.trainers)} trainer(s), {what}, {plan.load} burner(s); "
        f"at start: {load_text()}", flush=True)
    rows, failures = [], []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None   # SIGTERM: clean up too
    try:
        with Burners(plan.load):
            for k, trainer in enumerate(plan.trainers, 1):
                for i in range(1, plan.runs + 1):
                    run_dir = plan.out_dir / f"t{k}-{_slug(trainer.label)}-run{i}"
                    run_dir.mkdir(parents=True, exist_ok=True)
                    start = time.monotonic()
                    outcome = run(plan.command(trainer, i, report_dir=run_dir, basetemp=run_dir / "tmp"), run_dir)
                    seconds = time.monotonic() - start
                    for check, message in outcome.failures:
                        first = message.strip().splitlines()
                        select = check.split("[")[0] if not check.startswith("(") else None
                        replay = plan.command(trainer, i, select=f"test_{select}" if select else None)
                        line = (f"{trainer.label} run {i}: {check}: {first[0] if first else ''} "
                                f"(seed {plan.seed_text(i)})")
                        line += "".join(f"; {e.summary()}" for e in outcome.settled if e.check == check)
                        failures.append((line, shlex.join(replay)))
                    rows.append((trainer.label, i, plan.seed_text(i), seconds, outcome))
                    out(f"{trainer.label} run {i}/{plan.runs} seed {plan.seed_text(i)}: "
                        f"{len(outcome.failures)} failure(s){outcome.settled_text()}, {_counts_text(outcome.counts)} "
                        f"in {seconds:.0f}s",
                        flush=True)
            out(f"soak: at end: {load_text()}", flush=True)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    out("")
    out(_table(rows))
    out(f"\nsoak: {len(rows)} run(s) of the '{plan.profile}' profile against {len(plan.trainers)} trainer(s); "
        f"{sum(bool(r[4].failures) for r in rows)} run(s) with failures. Reports under {plan.out_dir}")
    settled = [e for r in rows for e in r[4].settled]
    raced = sum(e.reproduced for e in settled)
    out(f"soak: failures settled by repetition: {raced} intermittent, {len(settled) - raced} not reproducible; "
        f"{sum(r[4].disagreements for r in rows)} runner disagreement(s)")
    for line, replay in failures:
        out(f"  FAIL {line}")
        out(f"    replay: {replay}")
    return 1 if failures else 0


def _table(rows) -> str:
    head = ("trainer", "run", "seed", "seconds", "failures", "outcomes")
    body = [(label, str(i), seed, f"{seconds:.0f}", str(len(o.failures)), _counts_text(o.counts))
            for label, i, seed, seconds, o in rows]
    widths = [max(len(r[c]) for r in [head, *body]) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head, *body])


def main(args) -> int:
    try:
        planned = plan(args)
    except SoakUsageError as exc:
        print(f"{USAGE}{exc}", file=sys.stderr)
        return 2
    return campaign(planned)
