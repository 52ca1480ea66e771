"""What the checks share within one pytest session: the trainer, its runner, and every run they
would otherwise repeat (baselines, the determinism run, the prefix run, plain resumes). Each cached
value is a pure function of (adapter, spec): computed once, then read.

What two uninterrupted runs say of the trainer's noise is noise.py's to judge, and where the runs
keep their checkpoint directories scratch.py's to choose: this module runs, caches and hands out."""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
from pathlib import Path

from ..faults.scenario import CrashNotLanded, CrashPointMissing, run_schedule
from ..model.adapters import TrainerAdapter
from ..model.crash import CrashPoint
from ..model.flags import replay_settings
from ..model.process import RunSpec
from ..model.settings import DEFAULT_GRACE_S, DEFAULT_HANG_TIMEOUT_S, DEFAULT_TOL
from ..run.fresh import SubprocessRunner
from ..run.runners import Limits, ProcessOverran, Runner, traced_run
from ..run.warm import WarmRunner
from ..trace.recording import RecordedRun
from ..trace.strace import strace_problem
from . import digests, noise
from .failures import ConformanceFailure, fail, loss_mismatches, stderr_tail
from .fixes import EXITED_BEFORE_STEP_1, STALLED_BEFORE_STEP_1
from .scratch import scratch_root
from .tolerance import Tolerance


class Session:
    """One trainer under test, with a per-session cache of the runs every check needs."""

    def __init__(self, adapter: TrainerAdapter, workdir: Path | None = None, runner: Runner | None = None,
                 tol: float = DEFAULT_TOL, plot_dir: Path | None = None, process_timeout: float | None = None,
                 grace_s: float = DEFAULT_GRACE_S, cold: str = "file", resume_python: str | None = None,
                 hang_timeout: float = DEFAULT_HANG_TIMEOUT_S):
        self.adapter = dataclasses.replace(adapter, settings=replay_settings(   # a replay runs as this session did
            loss_tol=tol, process_timeout=process_timeout, grace_seconds=grace_s, hang_timeout=hang_timeout,
            cold_url=cold, resume_python=resume_python))
        self.resume_python = resume_python   # upgrade_resume: another environment's interpreter
        self.hang_timeout = hang_timeout     # hang: how long a job may run with one rank stopped
        self.cold = cold          # capability cold_tier: "file" or s3://bucket/prefix (process.cold_root)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="conformance-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.scratch = scratch_root(self.workdir)
        self.plot_dir = Path(plot_dir) if plot_dir else self.workdir / "plots"
        self.runner: Runner = runner or WarmRunner()
        self.cap = tol          # --loss-tol: the most any comparison allows (tolerance() learns the rest)
        self.process_timeout = process_timeout
        self.grace_s = grace_s   # how long a SIGTERMed trainer may run before SIGKILL (preemption)
        # Until a baseline has run, nothing is known of the trainer's speed: generous limits.
        self.runner.limits = Limits(total_s=process_timeout or 600.0,
                                    stall_s=process_timeout / 2 if process_timeout else 120.0)
        self._cache: dict[tuple, object] = {}
        self._lock = threading.RLock()   # crash states ask from several threads: compute each value once
        self._resumes: dict[tuple, tuple] = {}   # (probe, directory key) -> (result, what it named, where it ran)
        self.resumes_shared = 0                  # how many resumes shared_resume did not run again
        self._twin: Session | None = None        # fresh_twin
        self._noise_of: Session = self           # whose determinism runs measured the noise (a twin: its parent's)
        self.verdict_only = False   # a fresh twin: a failure's verdict only (no plot, no likely-cause experiments)

    def _cached(self, key: tuple, compute):
        """compute() once per key; a failure is kept and raised again (a trainer that hangs costs
        one time limit, not one per check)."""
        with self._lock:
            if key not in self._cache:
                try:
                    self._cache[key] = ("ok", compute())
                except (ConformanceFailure, ProcessOverran) as exc:
                    self._cache[key] = ("raise", exc)
            kind, value = self._cache[key]
            if kind == "raise":
                raise value
            return value

    def shared_resume(self, probe: RunSpec, content: str, observe: bool, run) -> tuple:
        """A resume of `probe` in a state directory whose files are `content` (DirectoryView.read's
        key): `run()` once per session, which returns (result, what it named or None, the state
        directory it ran in). The offline checks leave many of the same directories: a power cut
        that lost nothing unsynced leaves what a kill there leaves. A kept run that was not
        observed does not answer an `observe` request (unseen.py needs what it named)."""
        key = (probe, content)
        with self._lock:
            kept = self._resumes.get(key)
            if kept is not None and (kept[1] is not None or not observe):
                self.resumes_shared += 1
                return kept
        result, named, where = run()
        kept = (dataclasses.replace(result, traces={}, trace_text=""), named, where)
        with self._lock:
            self._resumes[key] = kept
        return kept

    def limits_after(self, baseline: RecordedRun) -> Limits:
        """Per-process limits once a baseline's duration is known: twenty times it (at least 120 s)
        in all, since a loaded machine may slow a later run well past its baseline; and five times
        it (at least 30 s; a job at least Limits.job_stall_s) without progress, which load does not
        cause (watchdog.progressed). --process-timeout caps both."""
        d = baseline.result.seconds
        total = self.process_timeout or max(120.0, 20 * d)
        return Limits(total_s=total, stall_s=min(total, max(30.0, 5 * d)))

    def fresh_twin(self) -> Session | None:
        """This trainer under a fresh interpreter per process, with this session's settings, in a
        directory of its own (None when this session's runner starts fresh interpreters already):
        where a failure found under the warm runner is replayed before it is reported."""
        if self.runner.fresh() is self.runner or (isinstance(self.runner, WarmRunner) and self.runner.runs_fresh(self.adapter)):
            return None
        with self._lock:
            if self._twin is None:
                twin = Session(self.adapter, self.workdir / "fresh-twin", runner=SubprocessRunner(jobs=self.runner.jobs),
                               tol=self.cap, plot_dir=self.plot_dir, process_timeout=self.process_timeout,
                               grace_s=self.grace_s, cold=self.cold, resume_python=self.resume_python,
                               hang_timeout=self.hang_timeout)
                twin.verdict_only = True
                twin._noise_of = self       # the same trainer: its noise, measured once, holds
                for key, value in self._cache.items():   # the fresh second runs are its baselines
                    if key[0] == "second" and value[0] == "ok":
                        twin._cache[("baseline", key[1])] = value
                        twin.runner.limits = twin.limits_after(value[1])
                self._twin = twin
            return self._twin

    def close(self) -> None:
        if self._twin is not None:
            self._twin.close()
        self.runner.close()
        if self.scratch != self.workdir:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def case_dir(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.scratch))

    def trace_problem(self) -> str | None:
        """Why this trainer's runs cannot be traced here, or None."""
        if not self.adapter.has("syscall_crash"):
            return "adapter lacks capability 'syscall_crash' (it may not run under strace)"
        problem = strace_problem()
        return f"syscall tracing unavailable: {problem}" if problem else None

    def fail(self, check: str, spec: RunSpec, problem: str, **kw):
        return fail(check, self.adapter, spec, problem, **kw)

    # -- uninterrupted runs -------------------------------------------------------------------------
    def baseline(self, spec: RunSpec) -> RecordedRun:
        """The uninterrupted run every verdict compares with, recorded with its data (crash states
        are rebuilt from it)."""
        return self._cached(("baseline", spec), lambda: self._uninterrupted(spec, "baseline", data=True))

    def second_run(self, spec: RunSpec) -> RecordedRun:
        """Another uninterrupted run, in a fresh interpreter (a warm runner's too): what differs
        from the baseline is run-random, nondeterministic, or depends on the process it runs in, as
        it then differs in every real restart. A warm runner's is recorded as a baseline is, so that
        the fresh twin (fresh_twin) that confirms a failure starts from it."""
        fresh = self.runner.fresh()
        return self._cached(("second", spec), lambda: self._uninterrupted(
            spec, "second", data=fresh is not self.runner, runner=fresh))

    def stable_paths(self, spec: RunSpec) -> frozenset[str]:
        """Relative paths under the checkpoint directory that two uninterrupted runs share (no
        run-random part): a kill at an operation on one, in a job or a process whose calls come
        from several threads, is delivered by path. Empty for a single-threaded process (its kills
        are delivered by count)."""
        def compute():
            if not spec.is_job and not self.baseline(spec).threaded:
                return frozenset()
            def paths(run: RecordedRun) -> set[str]:
                return {p for op in run.ops if op.inside for p in (op.path, op.target) if p}
            return frozenset(paths(self.baseline(spec)) & paths(self.second_run(spec)))
        return self._cached(("stable", spec), compute)

    def _uninterrupted(self, spec: RunSpec, tag: str, *, data: bool, runner: Runner | None = None) -> RecordedRun:
        try:
            run = traced_run(runner or self.runner, self.adapter, spec, self.case_dir(tag), tag=tag, data=data,
                             trace=self.trace_problem() is None)
        except ProcessOverran as exc:
            what = "the first uninterrupted run" if tag == "baseline" else "an uninterrupted run"
            raise self.fail("determinism_precondition", spec, f"{what}: the trainer {exc.problem}",
                            details=(exc.details + "\n" if exc.details else "") + "  stderr:\n"
                            + stderr_tail(exc.result.stderr),
                            fix=None if exc.result.losses else STALLED_BEFORE_STEP_1) from None
        if tag == "baseline":
            self.runner.limits = self.limits_after(run)
        if spec.world_size > 1:
            self._check_rank_logs(spec, run, tag)
        if run.result.returncode != 0 and not run.losses:
            raise self.fail("determinism_precondition", spec,
                            f"an uninterrupted run of {self.adapter.spec.removeprefix('cmd:') or self.adapter.name} "
                            f"exited {run.result.returncode} before it logged step 1: no check can run a trainer that "
                            "does not start",
                            details="  stderr:\n" + stderr_tail(run.result.stderr), fix=EXITED_BEFORE_STEP_1)
        if run.result.returncode != 0:
            raise self.fail("determinism_precondition", spec, f"an uninterrupted run exited {run.result.returncode}",
                            details="  stderr:\n" + stderr_tail(run.result.stderr))
        missing = [s for s in range(1, spec.total_steps + 1) if s not in run.losses]
        if missing:
            raise self.fail("determinism_precondition", spec,
                            f"an uninterrupted run logged no loss for steps {missing[:5]} "
                            "(CONFORMANCE_LOSS_LOG must get one line per step)")
        return run

    def _check_rank_logs(self, spec: RunSpec, run: RecordedRun, tag: str) -> None:
        """A multi-rank trainer logs one curve per rank; one that ignores WORLD_SIZE writes one log."""
        log = run.ckpt_dir.parent / f"{tag}-loss.jsonl"   # where traced_run put the plain log
        silent = [r for r, losses in enumerate(run.result.rank_losses) if not losses]
        if not silent:
            return
        single = log.exists() and log.stat().st_size > 0
        how = (f"it wrote one loss log ({log.name}) instead: the trainer ignores WORLD_SIZE" if single else
               "those ranks logged nothing")
        raise self.fail("determinism_precondition", spec,
                        f"a {spec.world_size}-rank run left no loss log for rank(s) {silent}: {how}",
                        details="  with WORLD_SIZE > 1 rank r appends its local loss to $CONFORMANCE_LOSS_LOG.rank{r} "
                                "(one JSON line per step), so each rank's curve can be compared with its own "
                                "baseline\n  stderr:\n" + stderr_tail(run.result.stderr))

    def determinism(self, spec: RunSpec) -> noise.Determinism:
        """Whether this trainer's uninterrupted runs of `spec` agree, and how noisy they are
        (noise.measure): the baseline and the second run, measured once."""
        return self._cached(("determinism", spec), lambda: self._determinism(spec))

    def tolerance(self, spec: RunSpec) -> Tolerance:
        """The tolerance every loss comparison of `spec`'s runs is held to (tolerance.py), learned
        from this trainer's run-to-run noise: measured on `spec` where its determinism runs exist,
        else the largest measured on another shape of the same trainer (a check's shorter or longer
        run), else measured now."""
        owner = self._noise_of
        with owner._lock:
            mine = owner._cache.get(("determinism", spec))
            known = [v for k, (kind, v) in owner._cache.items() if k[0] == "determinism" and kind == "ok"]
        if mine is not None and mine[0] == "ok":
            return mine[1].tolerance
        if known:
            return max((d.tolerance for d in known), key=lambda t: t.value)
        return owner.determinism(spec).tolerance

    def _determinism(self, spec: RunSpec) -> noise.Determinism:
        base = self.baseline(spec)
        return noise.measure(spec, base, self.second_run(spec), self.cap, traced=self.trace_problem() is None,
                             warm_again_agrees=lambda: self._warm_again_agrees(spec, base))

    def _warm_again_agrees(self, spec: RunSpec, base: RecordedRun) -> bool:
        """With a warm runner whose fresh run differed from the baseline: whether another warm run
        (losses only) repeats the baseline; then the difference is the process's, not noise."""
        if self.runner.fresh() is self.runner:
            return False
        again = self.run_once(spec, "warm-again")
        return again.result.returncode == 0 and again.losses == base.losses

    def prefix(self, spec: RunSpec, stop: int | None = None) -> tuple[RecordedRun, int]:
        """A traced run stopped at the last save before total_steps (or at `stop`, a save step),
        keeping an older save."""
        if stop is None:
            stop = spec.save_every * ((spec.total_steps - 1) // spec.save_every)
        if stop < 2 * spec.save_every:
            raise ValueError(f"total_steps={spec.total_steps} leaves no room for two saves "
                             f"before the end with save_every={spec.save_every}")

        def compute():
            short = spec.but(total_steps=stop)
            return traced_run(self.runner, self.adapter, short, self.case_dir("prefix"), tag="prefix"), stop
        return self._cached(("prefix", spec, stop), compute)

    def files_read_on_resume(self, spec: RunSpec, stop: int | None = None) -> frozenset[str]:
        """Files (relative to the checkpoint directory) a resume from the prefix run's directory
        (see prefix) opens: damage goes to files a resume reads, not to a copy the trainer never
        reads; and a file that the resume from an older save reads too may make that save
        unusable as well."""
        prefix, at = self.prefix(spec, stop)

        def compute():
            return traced_run(self.runner, self.adapter, spec.but(total_steps=at + 1),
                              self.case_dir("reads"), tag="resume", prepare=prefix.ckpt_dir).reads
        return self._cached(("reads", spec, at), compute)

    def run_once(self, spec: RunSpec, tag: str, *, adapter: TrainerAdapter | None = None,
                 prepare: Path | None = None) -> RecordedRun:
        """One untraced run to the end (losses and exit only): of this trainer or `adapter` (the same
        trainer in another environment), on a copy of `prepare` (a checkpoint directory) or fresh."""
        return traced_run(self.runner, adapter or self.adapter, spec, self.case_dir(tag), tag=tag, prepare=prepare,
                          trace=False)

    def other_baseline(self, spec: RunSpec, adapter: TrainerAdapter) -> RecordedRun:
        """The uninterrupted run in another environment (upgrade_resume), losses only."""
        return self._cached(("other-baseline", spec, adapter.argv),
                            lambda: self.run_once(spec, "other-baseline", adapter=adapter))

    def plain_resume_losses(self, spec: RunSpec, step: int) -> dict[int, float] | None:
        """Losses of a resume from the checkpoint of `step` after a plain kill between steps (no
        kill inside a save, nothing damaged), or None if that cannot be arranged. A curve that
        matches this one came from a whole checkpoint, whatever else is wrong with the resume."""
        def compute():
            if not 0 < step < spec.total_steps:
                return None
            try:
                outcome = run_schedule(self.runner, self.adapter, spec, (CrashPoint("step", step),),
                                       self.case_dir("plain-resume"), self.baseline(spec))
            except (CrashNotLanded, CrashPointMissing):
                return None
            ok = outcome.final_resumed_from == step and outcome.final.returncode == 0
            return outcome.final.losses if ok else None
        return self._cached(("plain", spec, step), compute)

    def same_as_plain_resume(self, spec: RunSpec, step: int, losses: dict[int, float]) -> bool:
        plain = self.plain_resume_losses(spec, step)
        tol = self.tolerance(spec)
        return (bool(plain) and bool(losses) and set(losses) <= set(plain)
                and not loss_mismatches(plain, losses, tol.value)
                and digests.first_state_mismatch(plain, losses, tol.digests) is None)
