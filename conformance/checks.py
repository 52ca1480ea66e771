"""The checks, as plain functions shared by the pytest suite and `python -m conformance replay`.

Each raises ConformanceFailure (an AssertionError) with the full report, or returns quietly.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import report
from .adapters import LegacySample, TrainerAdapter
from .corrupt import KINDS, corrupt, plant_malicious_pickle
from .crash_states import (build_state, crash_states, judge_state, parse_recording, probe_specs,
                           record_prefix, resumed_past)
from .crash import CrashPoint, Schedule, format_schedule
from .judge import fail, format_mismatches, loss_mismatches, stderr_tail
from .plots import plot_name, plot_resume
from .scenario import CrashNotLanded, CrashPointMissing, TrialOutcome, resume_point, run_schedule
from .trials import Baseline, RunSpec, WarmRunner, traced_run

CHECK_IDS = ("determinism_precondition", "resume_matches_baseline", "no_lost_work", "no_torn_state",
             "crash_states", "corruption_detected", "untrusted_checkpoint", "schema_migration")
DEFAULT_TOL = 1e-4
# Checks run once per parameter; the test id is `<check>[<param>]` (what expected-failure entries match).
CHECK_PARAMS = {"no_lost_work": ("between_saves", "inside_save"), "corruption_detected": KINDS}


class Session:
    """Per-process cache of baselines (one traced uninterrupted run per adapter and spec)."""

    def __init__(self, adapter: TrainerAdapter, workdir: Path | None = None, runner=None,
                 tol: float = DEFAULT_TOL, plot_dir: Path | None = None):
        self.adapter = adapter
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="conformance-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.scratch = scratch_root(self.workdir)
        self.plot_dir = Path(plot_dir) if plot_dir else self.workdir / "plots"
        self.runner = runner or WarmRunner()
        self.tol = tol
        self._baselines: dict[tuple, Baseline] = {}
        self._determinism: dict[RunSpec, str | None] = {}
        self._determinism_numbers: dict[RunSpec, dict] = {}
        self._prefixes: dict[RunSpec, tuple[Baseline, int]] = {}
        self._recordings: dict[RunSpec, list] = {}
        self._plain: dict[tuple[RunSpec, int], dict[int, float] | None] = {}
        self._plain_lock = threading.Lock()
        self._reads: dict[RunSpec, set[str]] = {}

    def close(self) -> None:
        close = getattr(self.runner, "close", None)
        if close:
            close()
        if self.scratch != self.workdir:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def case_dir(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.scratch))

    def baseline(self, spec: RunSpec) -> Baseline:
        key = (spec,)
        if key not in self._baselines:
            base = traced_run(self.runner, self.adapter, spec, self.case_dir("baseline"))
            if base.result.returncode != 0:
                raise fail("determinism_precondition", self.adapter, spec,
                           f"an uninterrupted run exited {base.result.returncode}",
                           details="  stderr:\n" + stderr_tail(base.result.stderr))
            missing = [s for s in range(1, spec.total_steps + 1) if s not in base.losses]
            if missing:
                raise fail("determinism_precondition", self.adapter, spec,
                           f"an uninterrupted run logged no loss for steps {missing[:5]} "
                           "(CONFORMANCE_LOSS_LOG must get one line per step)")
            self._baselines[key] = base
        return self._baselines[key]

    def determinism_problem(self, spec: RunSpec) -> str | None:
        if spec not in self._determinism:
            base = self.baseline(spec)
            d = self.case_dir("determinism")
            (d / "ckpt").mkdir()
            again = self.runner.run_process(self.adapter, spec, (d / "ckpt").resolve(), (d / "loss.jsonl").resolve())
            rows = loss_mismatches(base.losses, again.losses, self.tol)
            worst = report.max_abs_diff(base.losses, again.losses)
            self._determinism_numbers[spec] = dict(
                spec=dict(total_steps=spec.total_steps, save_every=spec.save_every, seed=spec.seed),
                exit_codes=[base.result.returncode, again.returncode], steps=len(base.losses),
                max_abs_diff=worst, tolerance=self.tol, mismatches=report.mismatch_rows(rows[:10]),
                summary=f"two uninterrupted runs, {len(base.losses)} steps, max |diff| "
                        + (f"{worst:.3g}" if worst is not None else "n/a"))
            problem = None
            if again.returncode != 0:
                problem = f"a second uninterrupted run exited {again.returncode}\n" + stderr_tail(again.stderr)
            elif rows or set(again.losses) != set(base.losses):
                problem = ("not deterministic without interruption: two uninterrupted runs differ\n"
                           + format_mismatches(rows))
            self._determinism[spec] = problem
        return self._determinism[spec]

    def recording(self, spec: RunSpec) -> list:
        """Every filesystem operation (with its data) of one uninterrupted run, for crash states."""
        if spec not in self._recordings:
            d = self.case_dir("recording")
            ckpt, log, trace = (d / "ckpt").resolve(), (d / "loss.jsonl").resolve(), d / "record.strace"
            ckpt.mkdir()
            result = self.runner.run_process(self.adapter, spec, ckpt, log, prefix=record_prefix(trace),
                                             trace_file=trace)
            if result.returncode != 0:
                raise fail("crash_states", self.adapter, spec, f"the recorded run exited {result.returncode}",
                           details="  stderr:\n" + stderr_tail(result.stderr))
            self._recordings[spec] = parse_recording(result.trace_text, ckpt, log)
            trace.unlink(missing_ok=True)
        return self._recordings[spec]

    def plain_resume_losses(self, spec: RunSpec, step: int) -> dict[int, float] | None:
        """Losses of a resume from the checkpoint of `step` after a plain kill between steps (no
        kill inside a save, nothing damaged), or None if that cannot be arranged. A curve that
        matches this one came from a whole checkpoint, whatever else is wrong with the resume."""
        key = (spec, step)
        with self._plain_lock:   # crash states ask from several threads; run each resume once
            return self._plain_resume_locked(key, spec, step)

    def _plain_resume_locked(self, key, spec: RunSpec, step: int) -> dict[int, float] | None:
        if key not in self._plain:
            losses = None
            if 0 < step < spec.total_steps:
                try:
                    outcome = run_schedule(self.runner, self.adapter, spec, (CrashPoint("step", step),),
                                           self.case_dir("plain-resume"), self.baseline(spec))
                    if outcome.resume_points[-1] == step and outcome.final.returncode == 0:
                        losses = outcome.final.losses
                except (CrashNotLanded, CrashPointMissing):
                    pass
            self._plain[key] = losses
        return self._plain[key]

    def same_as_plain_resume(self, spec: RunSpec, step: int, losses: dict[int, float]) -> bool:
        plain = self.plain_resume_losses(spec, step)
        return bool(plain) and bool(losses) and set(losses) <= set(plain) and not loss_mismatches(plain, losses, self.tol)

    def files_read_on_resume(self, spec: RunSpec) -> set[str]:
        """Files (relative to the checkpoint directory) a resume from the prefix run's directory
        opens: the corruption checks damage one of these, not a copy the trainer never reads."""
        if spec not in self._reads:
            prefix, stop = self.prefix(spec)
            resumed = traced_run(self.runner, self.adapter, RunSpec(stop + 1, spec.save_every, spec.seed),
                                 self.case_dir("reads"), tag="resume", prepare=prefix.ckpt_dir)
            root = str(resumed.ckpt_dir) + os.sep
            self._reads[spec] = {p[len(root):] for e in resumed.trace.entries if e.op == "read"
                                 and e.syscall in ("openat", "open") for p in e.paths if p.startswith(root)}
        return self._reads[spec]

    def prefix(self, spec: RunSpec) -> tuple[Baseline, int]:
        """A traced run stopped at the last save before total_steps, keeping an older save."""
        if spec not in self._prefixes:
            stop = spec.save_every * ((spec.total_steps - 1) // spec.save_every)
            if stop < 2 * spec.save_every:
                raise ValueError(f"total_steps={spec.total_steps} leaves no room for two saves "
                                 f"before the end with save_every={spec.save_every}")
            short = RunSpec(stop, spec.save_every, spec.seed)
            self._prefixes[spec] = (traced_run(self.runner, self.adapter, short, self.case_dir("prefix")), stop)
        return self._prefixes[spec]


# -- determinism ----------------------------------------------------------------------------------
def check_determinism(session: Session, spec: RunSpec) -> None:
    problem = session.determinism_problem(spec)
    report.record("determinism", **session._determinism_numbers.get(spec, {}))
    if problem:
        raise fail("determinism_precondition", session.adapter, spec, problem.splitlines()[0],
                   details="\n".join(problem.splitlines()[1:]))


# -- crash schedules ------------------------------------------------------------------------------
def run_trial(session: Session, spec: RunSpec, schedule: Schedule) -> TrialOutcome:
    return run_schedule(session.runner, session.adapter, spec, schedule, session.case_dir("trial"),
                        session.baseline(spec))


def plot_mismatch(session: Session, check: str, spec: RunSpec, *, schedule: Schedule | None = None,
                  extra: str = "", resumed: list[tuple[str, dict[int, float]]],
                  crashes: list[tuple[str, float]] = (), resumes: list[int] = ()) -> str:
    """Plot baseline vs resumed curves; returns the failure-message line naming the PNG."""
    path = session.plot_dir / plot_name(check, session.adapter.name, schedule, extra)
    title = (f"[{check}] {session.adapter.name}  total_steps={spec.total_steps} save_every={spec.save_every} "
             f"seed={spec.seed}" + (f"  schedule {format_schedule(schedule)}" if schedule is not None else "")
             + (f"  {extra}" if extra else ""))
    try:
        written = plot_resume(path, title=title, baseline=session.baseline(spec).losses, resumed=resumed,
                              crashes=list(crashes), resumes=list(resumes))
    except Exception as exc:  # a plot must never hide the verdict
        written = f"not written: {exc!r}"
    if isinstance(written, Path):
        report.record("plot", path=str(written))
    return f"  plot:     {written}"


def _plot_trial(session: Session, check: str, outcome: TrialOutcome) -> str:
    resumed = [(f"process 1 (killed at {outcome.crashed[0].point})", outcome.crashed[0].result.losses),
               *outcome.all_losses()]
    crashes = []
    for i, c in enumerate(outcome.crashed):
        start = 0 if i == 0 else max(outcome.resume_points[i - 1], 0)
        crashes.append((str(c.point), max(c.result.losses, default=start) + 0.5))
    return plot_mismatch(session, check, outcome.spec, schedule=outcome.schedule, resumed=resumed,
                         crashes=crashes, resumes=outcome.resume_points)


def _record_trial(session: Session, check: str, outcome: TrialOutcome) -> None:
    base = session.baseline(outcome.spec).losses
    compared, worst, rows = 0, None, []
    for _, losses in outcome.all_losses():
        compared += len(losses)
        d = report.max_abs_diff(base, losses)
        if d is not None:
            worst = d if worst is None else max(worst, d)
        rows += loss_mismatches(base, losses, session.tol)
    report.record("trial", check=check, schedule=format_schedule(outcome.schedule),
                  spec=dict(total_steps=outcome.spec.total_steps, save_every=outcome.spec.save_every,
                            seed=outcome.spec.seed),
                  crashes=[dict(point=str(c.point), planned=c.planned_text, inside_save_of=c.in_progress,
                                newest_committed=c.newest_committed, resumed_from=r)
                           for c, r in zip(outcome.crashed, outcome.resume_points)],
                  final_exit=outcome.final.returncode, steps_compared=compared, max_abs_diff=worst,
                  tolerance=session.tol, mismatches=report.mismatch_rows(rows[:10]))


def _describe_crashes(outcome: TrialOutcome) -> str:
    lines = []
    for i, c in enumerate(outcome.crashed):
        where = f"inside the save of step {c.in_progress}" if c.in_progress else "outside any save"
        r = outcome.resume_points[i]
        resumed = f"next process resumed from step {r}" if r >= 0 else "next process did not resume"
        lines.append(f"  crash {i + 1}: {c.point} = kill on entry to {c.planned_text} ({where}); "
                     f"newest committed checkpoint then: step {c.newest_committed}; {resumed}")
    return "\n".join(lines)


def judge_resume_matches_baseline(session: Session, outcome: TrialOutcome) -> None:
    spec, base = outcome.spec, session.baseline(outcome.spec)
    if outcome.final.returncode != 0:
        raise fail("resume_matches_baseline", session.adapter, spec,
                   f"the resumed run exited {outcome.final.returncode} after a plain kill (an in-place "
                   "or torn write looks like this from outside)", schedule=outcome.schedule,
                   details=_describe_crashes(outcome) + "\n  stderr of the resumed run:\n" + stderr_tail(outcome.final.stderr))
    for who, losses in outcome.all_losses():
        rows = loss_mismatches(base.losses, losses, session.tol)
        if rows:
            raise fail("resume_matches_baseline", session.adapter, spec,
                       f"{who}: loss differs from the uninterrupted run at {len(rows)} step(s) "
                       f"(tolerance {session.tol:g})", schedule=outcome.schedule,
                       details=_describe_crashes(outcome) + "\n  first differing steps:\n" + format_mismatches(rows)
                       + "\n" + _plot_trial(session, "resume_matches_baseline", outcome))
    last = max([s for _, l in outcome.all_losses() for s in l] + [outcome.resume_points[-1]])
    if last < spec.total_steps:
        raise fail("resume_matches_baseline", session.adapter, spec,
                   f"the resumed run stopped at step {last}, not {spec.total_steps}", schedule=outcome.schedule,
                   details=_describe_crashes(outcome))


def judge_no_lost_work(session: Session, outcome: TrialOutcome) -> None:
    for i, c in enumerate(outcome.crashed):
        r = outcome.resume_points[i]
        if r < 0:
            continue  # the next process never trained: judged by resume_matches_baseline / no_torn_state
        if r < c.newest_committed:
            what = "from scratch" if r == 0 else f"from step {r}"
            raise fail("no_lost_work", session.adapter, outcome.spec,
                       f"after crash {i + 1} the trainer resumed {what}, but the checkpoint of step "
                       f"{c.newest_committed} was committed before the kill", schedule=outcome.schedule,
                       details=_describe_crashes(outcome))
        upper = c.in_progress if c.in_progress else c.newest_committed
        if r > max(upper, c.newest_committed):
            raise fail("no_lost_work", session.adapter, outcome.spec,
                       f"after crash {i + 1} the trainer resumed from step {r}, later than any checkpoint "
                       f"that could have been written before the kill (step {upper})", schedule=outcome.schedule,
                       details=_describe_crashes(outcome))


def judge_no_torn_state(session: Session, outcome: TrialOutcome) -> None:
    base = session.baseline(outcome.spec)
    processes = [c.result for c in outcome.crashed[1:]] + [outcome.final]
    for i, c in enumerate(outcome.crashed):
        if not c.in_progress:
            continue
        nxt, r = processes[i], outcome.resume_points[i]
        if r < 0 or (not nxt.losses and nxt.returncode not in (0, -9, 137)):
            raise fail("no_torn_state", session.adapter, outcome.spec,
                       f"after a kill inside the save of step {c.in_progress} the trainer could not "
                       f"resume (exit {nxt.returncode}): it found a torn checkpoint", schedule=outcome.schedule,
                       details=_describe_crashes(outcome) + "\n  stderr:\n" + stderr_tail(nxt.stderr))
        if r not in (c.newest_committed, c.in_progress):
            continue  # lost work, judged by no_lost_work
        rows = loss_mismatches(base.losses, nxt.losses, session.tol)
        if rows and r > 0 and session.same_as_plain_resume(outcome.spec, r, nxt.losses):
            report.record("note", text=f"crash {i + 1}: the curve after resuming from step {r} diverges exactly "
                                       "as a plain resume from that checkpoint does: whole checkpoint, a "
                                       "resume_matches_baseline problem")
            continue
        if rows:
            raise fail("no_torn_state", session.adapter, outcome.spec,
                       f"after a kill inside the save of step {c.in_progress} the trainer resumed from "
                       f"step {r} and its losses differ: it loaded incomplete state", schedule=outcome.schedule,
                       details=_describe_crashes(outcome) + "\n  first differing steps:\n" + format_mismatches(rows)
                       + "\n" + _plot_trial(session, "no_torn_state", outcome))


JUDGES = {"resume_matches_baseline": judge_resume_matches_baseline, "no_lost_work": judge_no_lost_work,
          "no_torn_state": judge_no_torn_state}


def check_schedule(session: Session, check: str, spec: RunSpec, schedule: Schedule) -> TrialOutcome:
    outcome = run_trial(session, spec, schedule)
    _record_trial(session, check, outcome)
    JUDGES[check](session, outcome)
    return outcome


# -- crash states, rebuilt offline ----------------------------------------------------------------
MAX_STATE_FAILURES = 5
STATE_WORKERS = int(os.environ.get("CONFORMANCE_STATE_WORKERS", "0")) or min(4, os.cpu_count() or 1)


def check_crash_states(session: Session, spec: RunSpec, *, only: str | None = None) -> int:
    """Every state a kill can leave during one recorded run; returns how many were checked."""
    ops = session.recording(spec)
    states = crash_states(ops)
    if only is not None:
        states = [s for s in states if s.label == only]
        if not states:
            raise ValueError(f"no crash state {only!r}: labels are op numbers 0..{len(ops) - 1}, "
                             "with a 't' suffix for a torn write")
    base = session.baseline(spec).losses

    state_root = session.case_dir("states")

    committed_saves: set[int] = set()   # saves seen complete in some state: later states start there

    def check_one(state):
        d = Path(tempfile.mkdtemp(prefix=f"state-{state.label}-", dir=state_root))
        ckpt, log = (d / "ckpt").resolve(), (d / "loss.jsonl").resolve()
        probes = probe_specs(spec, state)
        if state.in_progress in committed_saves:
            probes = probes[-1:]   # one probe: resuming from either allowed checkpoint passes it
        for i, probe in enumerate(probes):
            build_state(ops, state, ckpt)
            log.unlink(missing_ok=True)
            result = session.runner.run_process(session.adapter, probe, ckpt, log)
            if i + 1 == len(probes) or not resumed_past(result):
                break
        if len(probes) > 1 and probe is probes[-1] and result.first_step == (state.in_progress or 0) + 1:
            committed_saves.add(state.in_progress)
        problem = judge_state(state, result, base, probe, session.tol)
        if problem and result.returncode == 0 and result.first_step and result.first_step > 1 \
                and session.same_as_plain_resume(spec, result.first_step - 1, result.losses):
            problem = None   # the same step as a plain resume from that checkpoint: it was whole
        if problem is None:
            shutil.rmtree(d, ignore_errors=True)
        return state, problem, result

    failures = []
    try:
        # States are independent: check several at once (each is one short forked process).
        with ThreadPoolExecutor(max_workers=STATE_WORKERS) as pool:
            for state, problem, result in pool.map(check_one, states):
                if problem:
                    failures.append((state, problem, result))
                    if len(failures) >= MAX_STATE_FAILURES:
                        pool.shutdown(cancel_futures=True)   # enough to report: skip the rest
                        break
    finally:
        # Passing states removed their directories; failing ones stay for inspection, next to the
        # session's other work files.
        if session.scratch != session.workdir:
            for d in state_root.iterdir():
                shutil.move(str(d), session.workdir / d.name)
        if not any(state_root.iterdir()):
            state_root.rmdir()
    report.record("crash_states", states=len(states), operations=len(ops), failed=len(failures),
                  failing=[s.label for s, _, _ in failures],
                  summary=f"{len(states)} crash states rebuilt from {len(ops)} recorded operations"
                          + (f", {len(failures)}+ failing" if failures else ", all resumed correctly"))
    if failures:
        state, problem, result = failures[0]
        others = "".join(f"\n    state {s.label}: {s.description}: {p}" for s, p, _ in failures[1:])
        raise fail("crash_states", session.adapter, spec,
                   f"in the state a {state.description} leaves, {problem}",
                   details=f"  state {state.label}: newest committed checkpoint then: step {state.newest_committed}"
                           + (f"; inside the save of step {state.in_progress}" if state.in_progress else "")
                           + f"\n  stderr:\n{stderr_tail(result.stderr)}"
                           + (f"\n  other failing states (first {MAX_STATE_FAILURES}):{others}" if others else ""),
                   extra=f"--state={state.label}")
    return len(states)


def scratch_root(workdir: Path) -> Path:
    """Where trainer processes keep their checkpoint directories during a session.

    CONFORMANCE_SCRATCH=workdir (default): the session's work directory. A path: a directory
    under it. `auto`: tmpfs (/dev/shm) when it has at least SCRATCH_MIN_FREE bytes free (a kill
    keeps the page cache, so durability plays no part in a verdict, and fsync there is free).
    Not the default, because the filesystem can change what a trainer does: Lightning's temp file
    lives in the system temp directory, and when the checkpoint directory is on another
    filesystem its "atomic" move becomes an in-place copy."""
    choice = os.environ.get("CONFORMANCE_SCRATCH", "workdir")
    if choice == "workdir":
        return workdir
    if choice != "auto":
        path = Path(choice)
        path.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="conformance-", dir=path))
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize >= SCRATCH_MIN_FREE and os.access(shm, os.W_OK):
            return Path(tempfile.mkdtemp(prefix="conformance-", dir=shm))
    except OSError:
        pass
    return workdir


SCRATCH_MIN_FREE = 2 << 30


# -- files of the newest checkpoint ---------------------------------------------------------------
def newest_checkpoint_files(prefix: Baseline, stop: int) -> list[Path]:
    """Regular files that the save of step `stop` wrote and that still exist after the run."""
    window = prefix.save_windows().get(stop, [])
    files: dict[str, None] = {}
    for i in window:
        ev = prefix.events[i]
        if ev.op == "rename" and len(ev.paths) == 2:
            # A renamed directory (e.g. a temp dir committed as `ckpt-<step>`) carries its files.
            src, dst = ev.paths
            files = {(dst + p[len(src):] if p == src or p.startswith(src + "/") else p): None for p in files}
        if ev.op in ("write", "rename", "create", "link"):
            files[ev.paths[-1]] = None
    return [Path(p) for p in files if Path(p).is_file() and not Path(p).is_symlink()]


def _copy_prefix(session: Session, spec: RunSpec, name: str, check: str) -> tuple[Path, list[Path], int]:
    prefix, stop = session.prefix(spec)
    d = session.case_dir(name)
    ckpt = (d / "ckpt").resolve()
    shutil.copytree(prefix.ckpt_dir, ckpt, symlinks=True)
    files = [ckpt / p.relative_to(prefix.ckpt_dir) for p in newest_checkpoint_files(prefix, stop)]
    if not files:
        raise fail(check, session.adapter, spec,
                   f"could not tell which files make up the checkpoint of step {stop}: the save "
                   "after logging that step wrote no file under CONFORMANCE_CKPT_DIR")
    return d, files, stop


def check_corruption(session: Session, spec: RunSpec, kind: str) -> None:
    check = "corruption_detected"
    d, files, stop = _copy_prefix(session, spec, f"corrupt-{kind}", "corruption_detected")
    read = session.files_read_on_resume(spec)
    ckpt = (d / "ckpt").resolve()
    candidates = [f for f in files if f.relative_to(ckpt).as_posix() in read] or files
    target = max(candidates, key=lambda p: p.stat().st_size)
    what = corrupt(kind, target)
    result = session.runner.run_process(session.adapter, spec, (d / "ckpt").resolve(), (d / "loss.jsonl").resolve())
    base = session.baseline(spec)
    previous = stop - spec.save_every
    details = f"  corruption: {what} (newest checkpoint: step {stop})"
    r = resume_point(result, spec)
    worst = report.max_abs_diff(base.losses, result.losses)
    report.record("corruption", corruption=kind, file=target.name, what=what, newest_step=stop,
                  exit_code=result.returncode, resumed_from=r, max_abs_diff=worst,
                  summary=f"{kind} {target.name}: exit {result.returncode}, "
                          + (f"resumed from step {r}" if result.returncode == 0 else "refused to resume"))
    if result.returncode != 0:
        if not result.stderr.strip():
            raise fail(check, session.adapter, spec, f"after corruption the trainer exited "
                       f"{result.returncode} without a message on stderr", details=details, extra=f"--corruption={kind}")
        return
    rows = loss_mismatches(base.losses, result.losses, session.tol)
    if rows and r > 0 and session.same_as_plain_resume(spec, r, result.losses):
        # The trainer resumed from step r exactly as from an undamaged checkpoint: the damage changed
        # nothing it used. (Its divergence is a resume_matches_baseline problem.)
        report.record("note", text=f"same curve as a plain resume from step {r}: the damage changed nothing the run used")
        rows = []
    if rows:
        plot = plot_mismatch(session, check, spec, extra=f"corruption={kind}",
                             resumed=[(f"resumed after {kind} of {target.name}", result.losses)], resumes=[r])
        raise fail(check, session.adapter, spec, f"the trainer loaded a corrupted checkpoint without noticing "
                   f"(resumed from step {r}, exit 0) and its loss curve diverges", details=details +
                   "\n  first differing steps:\n" + format_mismatches(rows) + "\n" + plot,
                   extra=f"--corruption={kind}")
    if r < previous:
        what_r = "from scratch" if r == 0 else f"from step {r}"
        raise fail(check, session.adapter, spec, f"after corruption the trainer resumed {what_r} instead of "
                   f"falling back to the newest intact checkpoint (step {previous})", details=details,
                   extra=f"--corruption={kind}")


def check_untrusted(session: Session, spec: RunSpec) -> None:
    """One file at a time: a loader that parses a safe file first would otherwise fail before it
    reaches the one it unpickles unsafely."""
    d, copies, stop = _copy_prefix(session, spec, "untrusted-0", "untrusted_checkpoint")
    outcomes = []
    for i in range(len(copies)):
        if i:   # a fresh copy for each file, so only that one file is replaced
            d, copies, _ = _copy_prefix(session, spec, f"untrusted-{i}", "untrusted_checkpoint")
        target = copies[i]
        marker = d / "UNTRUSTED-CODE-RAN"
        plant_malicious_pickle(target, marker)
        result = session.runner.run_process(session.adapter, spec, (d / "ckpt").resolve(), (d / "loss.jsonl").resolve())
        outcomes.append((target, marker.exists(), result))
    ran = [(t, r) for t, hit, r in outcomes if hit]
    report.record("untrusted", files=[t.name for t, _, _ in outcomes], code_ran=[t.name for t, _ in ran],
                  exit_codes=[r.returncode for _, _, r in outcomes],
                  summary=f"{len(outcomes)} file(s) replaced one at a time by a code-running pickle: code "
                          + (f"RAN for {', '.join(t.name for t, _ in ran)}" if ran else "never ran"))
    if ran:
        target, result = ran[0]
        raise fail("untrusted_checkpoint", session.adapter, spec,
                   f"loading the checkpoint of step {stop} ran code embedded in {target.name} "
                   "(weights_only=False or plain pickle on an untrusted file)",
                   details=f"  replaced (one at a time): {', '.join(t.name for t, _, _ in outcomes)}\n"
                           f"  code ran when replacing: {', '.join(t.name for t, _ in ran)}\n"
                           f"  exit code: {result.returncode}")


def check_legacy_sample(session: Session, spec: RunSpec, sample: LegacySample) -> None:
    check = "schema_migration"
    spec = RunSpec(spec.total_steps, spec.save_every, sample.seed)
    base = session.baseline(spec)
    d = session.case_dir("legacy")
    ckpt = (d / "ckpt").resolve()
    ckpt.mkdir()
    src = Path(sample.path)
    if src.is_dir():
        shutil.copytree(src, ckpt / sample.name)
    else:
        shutil.copy2(src, ckpt / sample.name)
    result = session.runner.run_process(session.adapter, spec, ckpt, (d / "loss.jsonl").resolve())
    details = f"  legacy sample: {src} (step {sample.step}, seed {sample.seed})"
    r = resume_point(result, spec)
    worst = report.max_abs_diff(base.losses, result.losses)
    report.record("legacy", sample=sample.name, step=sample.step, seed=sample.seed, exit_code=result.returncode,
                  resumed_from=r, max_abs_diff=worst,
                  summary=f"{sample.name}: exit {result.returncode}, resumed from step {r}")
    if result.returncode != 0:
        raise fail(check, session.adapter, spec, f"resuming from a legacy checkpoint exited {result.returncode}",
                   details=details + "\n  stderr:\n" + stderr_tail(result.stderr), extra=f"--legacy={sample.name}")
    if r != sample.step:
        raise fail(check, session.adapter, spec, f"the legacy checkpoint of step {sample.step} was not used: "
                   f"the trainer resumed from step {r}", details=details, extra=f"--legacy={sample.name}")
    rows = loss_mismatches(base.losses, result.losses, session.tol)
    if rows:
        plot = plot_mismatch(session, check, spec, extra=f"legacy={sample.name}",
                             resumed=[(f"resumed from {sample.name}", result.losses)], resumes=[r])
        raise fail(check, session.adapter, spec, "the run resumed from the migrated checkpoint diverges",
                   details=details + "\n  first differing steps:\n" + format_mismatches(rows) + "\n" + plot,
                   extra=f"--legacy={sample.name}")
