"""crash_states: every state a kill can leave during a whole run, rebuilt offline from the
baseline's recording (crash_states.py) and each decided by one short resume.

A state's verdict is a pure function of the state: which probes run, and how their outcome is
judged, depend on the state and the recording only.
"""
from __future__ import annotations

import functools
import operator
import os
import shutil
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..model import evidence
from ..model.process import ProcessResult, RunSpec
from ..offline.crash_states import CrashState, build_state, crash_states, distinct, probe_specs, same_directory_note
from ..offline.unseen import DirectoryView
from ..run.runners import Tracing
from ..trace import strace
from ..trace.recording import UnreplayableTrace
from .common import resumed_from
from .failures import CheckNotApplicable, loss_mismatches, stderr_tail
from .session import Session
from .tolerance import Tolerance

MAX_STATE_FAILURES = 5


def state_workers() -> int:
    """How many states are decided at once: CONFORMANCE_STATE_WORKERS, else the cores, at most 4."""
    return int(os.environ.get("CONFORMANCE_STATE_WORKERS", "0")) or min(4, os.cpu_count() or 1)



def _group(state) -> tuple | None:
    """States that may share a verdict without sharing a directory (unseen.py): the same judging
    and the same names; None for a state without a view."""
    view = getattr(state, "view", None)
    return None if view is None else (state.verdict_key[1:], view.names)


def decide_states(session: Session, name: str, prefix: str, same: dict, decide, left_out: list | None = None) -> list:
    """Decide the states `same` holds (distinct(): each representative -> the states that leave
    its directory), each in a fresh directory of its own: `decide(state, directory, observe)`
    returns (problem or None, result, the files its resume looked at or None: traced only with
    `observe`), or raises UnreplayableTrace when the state's directory cannot be built (a source
    outside the trace changed since the run was recorded): that state and those that leave its
    directory are left out, not decided, taken out of `same` and added to `left_out` as
    (state, why). Several at once: states are independent, each one short process.

    A state whose directory differs from a decided one's only in files that one's resume never
    looked at (unseen.py) takes its verdict without running, and moves into its list in `same`
    (updated in place, so `len(same)` is the number decided). Each round decides at most one
    state per group, in order, and the next round first matches the rest against it. A state
    alone in its group runs untraced: no other state could take its verdict.

    Returns [(state, problem, result)] for the failing ones, at most MAX_STATE_FAILURES (enough to
    report: the rest are skipped). Passing states' directories are removed; failing ones stay for
    inspection, moved next to the session's other work files when the scratch directory is
    elsewhere (a tmpfs), whatever happens meanwhile."""
    root = session.case_dir(name)

    def one(state, observe: bool):
        d = Path(tempfile.mkdtemp(prefix=f"{prefix}-{state.label}-", dir=root))
        try:
            problem, result, observed = decide(state, d, observe)
        except UnreplayableTrace as exc:
            shutil.rmtree(d, ignore_errors=True)
            return state, None, None, None, str(exc)
        if problem is None:
            shutil.rmtree(d, ignore_errors=True)
        return state, problem, result, observed, ""

    left_out = [] if left_out is None else left_out

    failures = []
    decided: dict[tuple, list] = {}   # group -> [(decided state, the files its resume looked at)]
    pending = list(same)
    try:
        with ThreadPoolExecutor(max_workers=state_workers()) as pool:
            while pending and len(failures) < MAX_STATE_FAILURES:
                batch, later, taken = [], [], set()
                for state in pending:
                    group = _group(state)
                    like = next((d for d, seen in decided.get(group, ()) if state.view.looks_like(d.view, seen)),
                                None) if group else None
                    if like is not None:
                        same[like] = [*same[like], state, *same.pop(state)]
                    elif group is not None and group in taken:
                        later.append(state)
                    else:
                        batch.append(state)
                        if group is not None:
                            taken.add(group)
                sizes = Counter(_group(state) for state in (*batch, *later))   # what is left to decide
                observe = [_group(state) is not None and sizes[_group(state)] > 1 for state in batch]
                for state, problem, result, observed, why in pool.map(one, batch, observe):
                    if why:
                        left_out += [(s, why) for s in (state, *same.pop(state))]
                        continue
                    if observed is not None and _group(state):
                        decided.setdefault(_group(state), []).append((state, observed))
                    if problem:
                        failures.append((state, problem, result))
                        if len(failures) >= MAX_STATE_FAILURES:
                            pool.shutdown(cancel_futures=True)
                            break
                pending = later
    finally:
        if session.scratch != session.workdir:
            for d in root.iterdir():
                shutil.move(str(d), session.workdir / d.name)
        if not any(root.iterdir()):
            root.rmdir()
    return failures


def resumed_past(result: ProcessResult) -> bool:
    """Exit 0 without training a step: the trainer found a checkpoint at or past total_steps."""
    return result.returncode == 0 and result.first_step is None


def judge_state(state: CrashState, result: ProcessResult, baseline: dict[int, float], spec: RunSpec,
                tol: Tolerance) -> str | None:
    """None if the trainer resumed correctly in this state, else what went wrong."""
    allowed = {state.newest_committed} | ({state.in_progress} if state.in_progress else set())
    if result.returncode != 0:
        return f"the trainer exited {result.returncode} (it found a torn or unreadable checkpoint)"
    if result.first_step is None:
        if max(allowed) >= spec.total_steps and (state.newest_committed >= spec.total_steps or state.save_complete):
            return None   # the final save's files were all in place: nothing is left to train
        return (f"the trainer exited 0 without training: it resumed from a step at or beyond "
                f"{spec.total_steps}, later than any checkpoint committed before the kill")
    resumed = result.first_step - 1
    if resumed not in allowed:
        want = " or ".join(f"step {s}" for s in sorted(allowed))
        what = resumed_from(resumed)
        return f"the trainer resumed {what}; expected {want} (newest committed before the kill)"
    bad = loss_mismatches(baseline, result.losses, tol)
    if bad:
        return f"the trainer resumed from step {resumed} but {bad.first_problem(baseline)}: it loaded incomplete state"
    return None


def observed_run(session: Session, probe: RunSpec, ckpt: Path, log: Path, observe: bool = True
                 ) -> tuple[ProcessResult, strace.Named | None]:
    """One probe, with `observe` traced for what it looks at (unseen.py): its result and what it
    named (None untraced, or if a process's trace is missing: a rank that ended before strace
    attached). Run once per directory content in a session (Session.shared_resume): crash_states
    and power_loss share it."""
    state_dir = ckpt.parent
    result, named, where = session.shared_resume(
        probe, DirectoryView.read(ckpt).key, observe,
        lambda: (*_observed_run(session, probe, ckpt, log, observe), state_dir))
    if named is not None and where != state_dir:
        named = named.rebased(str(where), str(state_dir))
    return result, named


def _observed_run(session: Session, probe: RunSpec, ckpt: Path, log: Path, observe: bool
                  ) -> tuple[ProcessResult, strace.Named | None]:
    if not observe:
        return session.runner.run_process(session.adapter, probe, ckpt, log), None
    trace = log.with_name("probe.strace")
    result = session.runner.run_process(session.adapter, probe, ckpt, log,
                                        tracing=Tracing.each(probe, trace, strace.observe_argv))
    texts = [result.traces.get(r, "") for r in range(probe.world_size)] if probe.is_job else [result.trace_text]
    for f in trace.parent.glob(trace.name + "*"):
        f.unlink()
    if not all(texts):
        return result, None
    return result, functools.reduce(operator.or_, map(strace.named, texts))


def looked_at(state, named: list[strace.Named | None], root: Path) -> frozenset[str] | None:
    """The files of `state` (built at `root`) its probes could have learned anything of, from
    what each named; None if unknown."""
    if getattr(state, "view", None) is None or not named or None in named:
        return None
    return state.view.seen(functools.reduce(operator.or_, named), root)


def decide_state(session: Session, spec: RunSpec, state: CrashState, directory: Path, observe: bool = True
                 ) -> tuple[str | None, ProcessResult, frozenset[str] | None]:
    """Build the state under `directory`, run its probes, judge; with the files they looked at."""
    run = session.baseline(spec)
    ckpt, log = (directory / "ckpt").resolve(), (directory / "loss.jsonl").resolve()
    named = []
    for probe in probe_specs(spec, state):
        build_state(run, state, ckpt)
        log.unlink(missing_ok=True)
        result, more = observed_run(session, probe, ckpt, log, observe)
        named.append(more)
        if not resumed_past(result):
            break
    problem = judge_state(state, result, run.losses, probe, session.tolerance(spec))
    if problem and result.returncode == 0 and result.first_step and result.first_step > 1 \
            and session.same_as_plain_resume(spec, result.first_step - 1, result.losses):
        problem = None   # the same steps as a plain resume from that checkpoint: it was whole
    return problem, result, looked_at(state, named, ckpt)


def not_judged(what: str, left_out: list[tuple[object, str]]) -> CheckNotApplicable:
    """The skip of a check none of whose states (`what`: "crash states") could be rebuilt offline:
    the suite's limit, never a verdict."""
    state, why = left_out[0]
    return CheckNotApplicable(f"not judged: none of the {len(left_out)} {what} could be rebuilt offline, so none was "
                              f"decided (state {state.label}: {why}); this says nothing of the trainer")


def left_out_reasons(left_out: list[tuple[object, str]]) -> tuple[str, ...]:
    """The first few distinct reasons states were left out, for the report."""
    return tuple(dict.fromkeys(why for _, why in left_out))[:3]


def crash_states_check(session: Session, check: str, spec: RunSpec, _param=None, only: str | None = None) -> int:
    """Every state a kill can leave during one recorded run; returns how many were decided. States
    that cannot be rebuilt are left out and counted; with every state left out, it is not judged."""
    run = session.baseline(spec)
    try:
        states = crash_states(run)
    except UnreplayableTrace as exc:
        evidence.record(evidence.CrashStates(states=len(run.mutations), operations=len(run.mutations), failed=0,
                                             left_out=len(run.mutations),
                                             left_out_reasons=(str(exc),)))
        raise CheckNotApplicable(f"not judged: the recorded run cannot be replayed offline ({exc}), so no crash state "
                                 "can be rebuilt; this says nothing of the trainer") from None
    if only is not None:
        states = [s for s in states if s.label == only]
        if not states:
            # Not this run's: a threaded trainer's op numbers differ between runs (a fresh
            # interpreter's confirmation), or the label is mistyped.
            raise CheckNotApplicable(f"no crash state {only!r} in this run: labels are op numbers 0..{len(run.ops) - 1}, "
                                     "with a 't' suffix for a torn write")
    left = [(s, s.left_out) for s in states if s.left_out]
    same = distinct([s for s in states if not s.left_out])
    directories = len(same)   # states that leave the same directory, judged alike, are decided once
    shared = session.resumes_shared
    failures = decide_states(session, "states", "state", same,
                             lambda state, d, observe: decide_state(session, spec, state, d, observe), left)
    evidence.record(evidence.CrashStates(states=len(states), operations=len(run.mutations), failed=len(failures),
                                         failing=tuple(s.label for s, _, _ in failures), distinct=directories,
                                         resumed=len(same), shared=session.resumes_shared - shared,
                                         left_out=len(left), left_out_reasons=left_out_reasons(left)))
    if not same and left:
        raise not_judged("crash states", left)
    if failures:
        state, problem, result = failures[0]
        others = "".join(f"\n    state {s.label}: {s.description}: {p}" for s, p, _ in failures[1:])
        problem += same_directory_note(same[state], "states")
        raise session.fail(
            check, spec, f"in the state a {state.description} leaves, {problem}",
            details=f"  state {state.label}: newest committed checkpoint then: step {state.newest_committed}"
                    + (f"; inside the save of step {state.in_progress}" if state.in_progress else "")
                    + f"\n  stderr:\n{stderr_tail(result.stderr)}"
                    + (f"\n  other failing states (first {MAX_STATE_FAILURES}):{others}" if others else ""),
            case={"state": state.label})
    return len(states) - len(left)
