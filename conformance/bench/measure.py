"""How fast the suite is, measured side by side in one run: `python -m conformance.bench [--json]`.

- one crash trial (a kill inside the middle save, then the resume to the end: two trainer
  processes, the first traced and killed by strace) on the warm runner, as a module and as a
  script (`python train.py`), and with a fresh interpreter per process, and a bare
  `python -c "import torch"` (medians);
- crash states checked per minute by the crash_states check (rebuilt offline, one short resume each);
- power-loss states (data and strict models) checked per minute by the power_loss check;
- the wall time of the `ci` profile against the bundled trainer with `-n auto`, and whether that
  run covered every filesystem operation of a save (its crash_states evidence);
- a 2-rank crash trial (the reference DDP trainer under torchrun, one rank killed inside the
  middle save) against the single-process warm trial, and the `ci` wall time for that trainer;
- what the state digests cost per warm trial (`digest_cost`, digests.py);
- a 2-node x 2-rank crash trial (the same trainer as 4 ranks on two torchrun agents meeting
  through c10d rendezvous, node 1 lost inside the middle save) against what the same interruption
  costs by hand: a bare 4-rank torchrun job (fresh interpreters, untraced) stopped once it logged
  that save's step, then the job resumed to the end; the two alternate trial by trial.

`python -m conformance.bench --ab OLD_CHECKOUT [--rounds N] [--json]` measures instead the warm
single-process crash trial of this checkout against the same trial run from an older checkout
(`git worktree add /tmp/old COMMIT`): each side runs in a subprocess of its own with its checkout
first on sys.path and as its working directory (its own suite, trainer and fork server), the two
alternating trial by trial (AB, BA, ...); it prints the new/old ratio (median of the per-pair
ratios, with their spread) and the raw times. A measurement, never a pass/fail.

Targets on 2 cores: trial_vs_import <= 0.1, script_trial_vs_import <= 0.1, integrity_states_per_min >= 1000,
power_loss_states_per_min >= 1000, ci_profile_seconds <= 90, multirank_trial_vs_single <= 3.0,
multirank_ci_profile_seconds <= 300, multinode_trial_vs_bare_pair <= 2.0, digest_cost <= 0.05.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..checks.states import state_workers
from ..model.settings import TOTAL_STEPS
from ..report.readme import replace_section
from .ab import ab, format_ab, interleaved_trials, median_time, spread
from .digests import digest_seconds
from .targets import MARKER, MULTIRANK_ADAPTER, TARGETS, format_markdown, met

# How long a bare `import torch` may take: seconds on a quiet machine, and however loaded the machine
# is, a benchmark that waits longer measures nothing.
IMPORT_S = 600


def bare_import_seconds(repeats: int) -> tuple[float, list[float]]:
    return median_time(lambda: subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=IMPORT_S),
                       repeats)


class TrialTimer:
    """Times one crash trial at a time on a prepared session (baseline recorded, one warm-up
    trial paid): the bundled trainer as `python -m module`, or with `script`, as `python
    train.py` (a script that calls the same trainer); with `multirank`, the 2-rank DDP trainer
    with rank 1 killed; with `multinode`, that trainer as 2 nodes x 2 ranks with node 1 lost."""

    def __init__(self, runner_kind: str, workdir: Path, *, script: bool = False, multirank: bool = False,
                 multinode: bool = False):
        import dataclasses

        from ..checks import Session
        from ..faults.strategies import first_in_save_point
        from ..model.adapters import command_adapter, resolve
        from ..model.process import RunSpec
        from ..model.settings import SEED, TOTAL_STEPS
        from ..run.fresh import SubprocessRunner
        from ..run.warm import WarmRunner

        runner = WarmRunner() if runner_kind == "warm" else SubprocessRunner()
        adapter = resolve(None, None)
        if script:
            path = workdir / "train.py"
            path.write_text("import sys\nfrom resume_conformance.fixtures.reference_trainer import main\nsys.exit(main())\n")
            adapter = command_adapter(f"{sys.executable} {path}")
        if multirank or multinode:
            adapter = resolve(MULTIRANK_ADAPTER, None, **({"world_size": 4, "nnodes": 2} if multinode else {}))
        tag = f"{runner_kind}{'-script' if script else ''}{'-multirank' if multirank else ''}" \
              f"{'-multinode' if multinode else ''}"
        self.session = Session(adapter, workdir / tag, runner=runner)
        try:
            self.spec = RunSpec(TOTAL_STEPS, 3, SEED, adapter.world_size, nnodes=adapter.nnodes)
            baseline = self.session.baseline(self.spec)
            rank = 2 if multinode else 1 if multirank else None
            self.point = first_in_save_point(baseline.rank_view(rank or 0), rank)
            if multinode:
                self.point = dataclasses.replace(self.point, node=1)
            from ..faults.scenario import plan
            self.save_step = plan(self.point, baseline).in_progress   # the save the point is inside
            self.once()   # warm-up: the fork server's imports are paid once
        except BaseException:
            self.session.close()
            raise

    def once(self) -> float:
        from ..checks.schedules import run_trial
        start = time.perf_counter()
        run_trial(self.session, self.spec, (self.point,))
        return time.perf_counter() - start

    def close(self) -> None:
        self.session.close()


class BarePairTimer:
    """What a multi-node trial's interruption costs without the suite: the same trainer as one bare
    4-rank torchrun job in fresh interpreters, untraced, stopped once it logged step `stop_after`
    (the step of the save the trial's node point is in), then a second job that resumes from what
    the first left and runs to the end."""

    def __init__(self, workdir: Path, stop_after: int):
        from ..model.adapters import resolve
        from ..model.process import RunSpec
        from ..model.settings import SEED, TOTAL_STEPS
        from ..run.fresh import SubprocessRunner

        self.adapter = resolve(MULTIRANK_ADAPTER, None, world_size=4, nnodes=1)
        self.spec = RunSpec(TOTAL_STEPS, 3, SEED, 4)
        self.runner, self.dir, self.stop_after, self.runs = SubprocessRunner(), workdir / "bare-pair", stop_after, 0

    def once(self) -> float:
        from ..run.watchdog import Stop
        self.runs += 1
        where = self.dir / str(self.runs)
        (where / "ckpt").mkdir(parents=True)
        start = time.perf_counter()
        first = self.runner.run_process(self.adapter, self.spec, where / "ckpt", where / "first.jsonl",
                                        stop=Stop(after_step=self.stop_after))
        second = self.runner.run_process(self.adapter, self.spec, where / "ckpt", where / "second.jsonl")
        seconds = time.perf_counter() - start
        if max(first.losses, default=0) >= self.spec.total_steps or max(second.losses, default=0) < self.spec.total_steps:
            raise RuntimeError(f"the bare 4-rank pair did not stop and resume as planned: first job logged "
                               f"{sorted(first.losses)}, second {sorted(second.losses)} ({where})")
        return seconds

    def close(self) -> None:
        """The jobs' checkpoints and logs: up to `repeats` 4-rank runs' worth, freed as soon as
        the pair's timings are taken."""
        shutil.rmtree(self.dir, ignore_errors=True)


def trial_seconds(runner_kind: str, repeats: int, workdir: Path, *, script: bool = False,
                  multirank: bool = False) -> tuple[float, list[float], str]:
    """One crash trial's median time (see TrialTimer)."""
    timer = TrialTimer(runner_kind, workdir, script=script, multirank=multirank)
    try:
        median, times = median_time(timer.once, repeats)
        return median, times, str(timer.point)
    finally:
        timer.close()


def states_per_minute(workdir: Path) -> tuple[float, int, float]:
    from ..checks import Session
    from ..checks.states import crash_states_check
    from ..model.adapters import resolve
    from ..model.process import RunSpec
    from ..model.settings import SEED, TOTAL_STEPS

    session = Session(resolve(None, None), workdir / "states")
    try:
        spec = RunSpec(TOTAL_STEPS, 3, SEED)
        session.baseline(spec)
        start = time.perf_counter()
        n = crash_states_check(session, "crash_states", spec)
        seconds = time.perf_counter() - start
        return n / seconds * 60, n, seconds
    finally:
        session.close()


def power_states_per_minute(workdir: Path) -> tuple[float, int, float]:
    """Power-loss states (both models) checked per minute against the bundled trainer."""
    from ..checks import Session
    from ..checks.power import power_loss
    from ..model.adapters import resolve
    from ..model.process import RunSpec
    from ..model.settings import SEED, TOTAL_STEPS

    session = Session(resolve(None, None), workdir / "power")
    try:
        spec = RunSpec(TOTAL_STEPS, 3, SEED)
        session.baseline(spec)
        session.plain_resume_losses(spec, 3)   # warm the fork server
        start = time.perf_counter()
        n = sum(power_loss(session, f"power_loss[{m}]", spec, m) for m in ("data", "strict"))
        seconds = time.perf_counter() - start
        return n / seconds * 60, n, seconds
    finally:
        session.close()


def ci_profile(workdir: Path, *args: str, tag: str = "ci") -> dict[str, Any]:
    from ..model.evidence import CrashStates
    from ..report.report import load_report
    rep = workdir / f"{tag}-report"
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "conformance", "-n", "auto", "-q", "-p", "no:cacheprovider",
           "--hypothesis-profile=conformance-ci", f"--conformance-report={rep}", f"--basetemp={workdir / f'{tag}-tmp'}",
           *args]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"seconds": seconds, "exit_code": proc.returncode,
                           "summary": (proc.stdout.strip().splitlines() or [""])[-1]}
    try:
        report = load_report(rep / "report.json")
    except ValueError as exc:
        out["covers_every_fs_op_of_a_save"] = False
        out["problem"] = str(exc)
        return out
    states = next((e for c in report.cases if c.check == "crash_states" for e in c.evidence
                   if isinstance(e, CrashStates)), None)
    out["crash_states_checked"] = states.states if states else 0
    out["recorded_operations"] = states.operations if states else 0
    # crash_states rebuilds the state before every recorded operation of the whole run (every save)
    out["covers_every_fs_op_of_a_save"] = bool(states) and states.states >= states.operations
    out["counts"] = report.counts
    return out


def run(repeats: int, fresh_repeats: int, with_ci: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="conformance-bench-") as tmp:
        tmp_path = Path(tmp)
        load_before = os.getloadavg()[0]
        import_s, import_all = bare_import_seconds(repeats)
        # The single-process and the 2-rank warm trials alternate, and their ratio is judged per pair.
        single, ranks, nodes, bare = TrialTimer("warm", tmp_path), None, None, None
        try:
            ranks = TrialTimer("warm", tmp_path, multirank=True)
            warm_all, ranks_all = interleaved_trials(single, ranks, repeats)
            ranks.close()
            nodes = TrialTimer("warm", tmp_path, multinode=True)
            bare = BarePairTimer(tmp_path, nodes.save_step)
            bare_all, nodes_all = interleaved_trials(bare, nodes, repeats)
            point, ranks_point, nodes_point = str(single.point), str(ranks.point), str(nodes.point)
        finally:
            single.close()
            for timer in (ranks, nodes, bare):
                if timer is not None:
                    timer.close()
        warm_s, ranks_s = statistics.median(warm_all), statistics.median(ranks_all)
        pair_ratios = [m / w for m, w in zip(ranks_all, warm_all)]
        node_ratios = [m / b for m, b in zip(nodes_all, bare_all)]
        script_s, script_all, _ = trial_seconds("warm", repeats, tmp_path, script=True)
        fresh_s, fresh_all, _ = trial_seconds("fresh", fresh_repeats, tmp_path)
        digest_s, compare_s = digest_seconds(tmp_path)
        per_min, n_states, states_s = states_per_minute(tmp_path)
        power_per_min, n_power, power_s = power_states_per_minute(tmp_path)
        ci = ci_profile(tmp_path) if with_ci else None
        ranks_ci = ci_profile(tmp_path, f"--adapter={MULTIRANK_ADAPTER}", tag="multirank-ci") if with_ci else None
        load_after = os.getloadavg()[0]
    result = {
        "trial_vs_import": warm_s / import_s,
        "script_trial_vs_import": script_s / import_s,
        "integrity_states_per_min": per_min,
        "power_loss_states_per_min": power_per_min,
        "ci_profile_seconds": ci["seconds"] if ci else None,
        "multirank_trial_vs_single": statistics.median(pair_ratios),
        "multirank_ci_profile_seconds": ranks_ci["seconds"] if ranks_ci else None,
        "multinode_trial_vs_bare_pair": statistics.median(node_ratios),
        # A trial's processes digest at each save step (the bundled trainers' rule) and once after the
        # resume; the suite compares 3 curves.
        "digest_cost": ((TOTAL_STEPS // 3 + 1) * digest_s + 3 * compare_s) / warm_s,
        "details": {
            "digest_per_step_s": digest_s, "digest_compare_per_curve_s": compare_s,
            "multinode_trial_s": statistics.median(nodes_all), "multinode_trial_schedule": nodes_point,
            "bare_pair_s": statistics.median(bare_all), "bare_pair_stop_after": bare.stop_after,
            "multinode_trial_vs_single": statistics.median(nodes_all) / statistics.median(warm_all),
            "multinode_trial_vs_bare_pair_spread": list(spread(node_ratios)),
            "multirank_trial_s": ranks_s, "multirank_trial_schedule": ranks_point, "multirank_ci": ranks_ci,
            "multirank_trial_vs_single_spread": list(spread(pair_ratios)),
            "bare_import_torch_s": import_s, "warm_trial_s": warm_s, "script_trial_s": script_s,
            "fresh_trial_s": fresh_s,
            "fresh_vs_warm": fresh_s / warm_s, "trial_schedule": point,
            "all_times_s": {"import": import_all, "warm_trial": warm_all, "script_trial": script_all,
                            "fresh_trial": fresh_all, "multirank_trial": ranks_all,
                            "bare_4_rank_pair": bare_all, "multinode_trial": nodes_all},
            "crash_states": n_states, "crash_states_seconds": states_s,
            "power_loss_states": n_power, "power_loss_seconds": power_s,
            "state_workers": state_workers(),
            "ci": ci, "repeats": repeats, "fresh_repeats": fresh_repeats,
            "load_avg_before_after": [round(load_before, 2), round(load_after, 2)],
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": _torch_version()},
        },
    }
    result["targets_met"] = {k: met(k, result[k]) for k in TARGETS}
    return result


def _torch_version() -> str | None:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, timeout=IMPORT_S)
    return out.stdout.strip() or None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m conformance.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=7, help="warm trials and bare imports (median)")
    parser.add_argument("--fresh-repeats", type=int, default=3, help="fresh-interpreter trials (median)")
    parser.add_argument("--no-ci", action="store_true", help="skip the ci-profile run (it takes a minute)")
    parser.add_argument("--update-readme", metavar="PAGE", help=f"replace the section after {MARKER} in this "
                        "Markdown page (docs/benchmarks.md)")
    parser.add_argument("--ab", metavar="OLD_CHECKOUT", help="only the warm crash trial, this checkout against "
                        "the one at OLD_CHECKOUT (e.g. a `git worktree add` of an older commit), alternating: "
                        "prints the new/old ratio")
    parser.add_argument("--rounds", type=int, default=15, help="with --ab: alternating pairs of trials (median)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ab:
        ab_result = ab(Path(args.ab), max(1, args.rounds))
        print(json.dumps(ab_result, indent=1) if args.json else format_ab(ab_result))
        return 0
    result = run(args.repeats, args.fresh_repeats, not args.no_ci)
    command = "python -m conformance.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.update_readme:
        replace_section(Path(args.update_readme), MARKER, format_markdown(result, command.strip()))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_markdown(result, command.strip()))
    return 0

