"""compound_faults[kill_then_damage|power_then_damage]: a kill or a power cut inside a save, then
the newest committed checkpoint damaged (each file only it has, truncated to half): the next start
must fall back to the checkpoint the trainer's own retention promised to keep beside it.

The promise is learned from the uninterrupted run (offline/retained.py): the older checkpoints
present right after the damaged one's save ended. Retention that deletes an old restore point
before the new checkpoint is committed passes every single-fault check and fails this one.

- Every checkpoint retention keeps beside the damaged one (as many as the run holds at its end) is
  still whole after the fault, unless the interrupted save's files were all written (its retention
  may then have gone): a trainer that deletes its oldest checkpoint before writing the new one fails
  even where an older fallback remains.
- If the next start trains, it resumes from the promised checkpoint or a newer intact one and
  matches the baseline; it never trains on the damaged state. Stopping loudly (exit non-zero) is
  allowed, as in corruption_detected, while what retention promised is still there; with nothing
  promised (a trainer that keeps one checkpoint) it may also start from scratch.
The state is rebuilt offline from the recording (offline/retained.py): the fault lands exactly.
"""
from __future__ import annotations

from hypothesis import strategies as st

from ..faults.injection import StateNotRebuilt
from ..faults.scenario import CrashPointMissing
from ..model import evidence
from ..model.process import RunSpec
from ..offline import retained
from ..trace.recording import RecordedRun, UnreplayableTrace
from .common import resumed_from
from .failures import CheckNotApplicable, format_mismatches, loss_mismatches, stderr_tail
from .session import Session

PARAMS = ("kill_then_damage", "power_then_damage")
_MODEL = {"kill_then_damage": "kill", "power_then_damage": "power"}


_USABLE: dict[tuple[int, str], tuple[RecordedRun, list[int]]] = {}


def usable_states(run: RecordedRun, param: str) -> list[int]:
    """Op indices where this case's fault leaves a committed checkpoint to damage (computed once
    per recording)."""
    key = (id(run), _MODEL[param])
    if key not in _USABLE or _USABLE[key][0] is not run:
        _USABLE[key] = (run, retained.candidates(run, _MODEL[param]))
    return _USABLE[key][1]


def draw_state(baseline: RecordedRun, param: str) -> st.SearchStrategy[int]:
    """An op index inside a save where the fault leaves a committed checkpoint to damage. A drawn
    state that cannot be rebuilt is left out as an undelivered draw (StateNotRebuilt); when none
    can be, the check is not judged."""
    if baseline.unreplayable:
        raise CheckNotApplicable(f"not judged: the recorded run cannot be replayed offline, so no state can be "
                                 f"rebuilt ({baseline.unreplayable}); this says nothing of the trainer")
    found = usable_states(baseline, param)
    if not found:
        why = ("no power cut inside a save leaves a committed checkpoint whole (its data is never fsynced: "
               "see power_loss[data])" if _MODEL[param] == "power" else
               "no save is interrupted after a committed one (the run has fewer than two saves)")
        raise CheckNotApplicable(f"nothing to damage: {why}")
    left = retained.left_out(baseline, _MODEL[param], found)
    if len(left) == len(found):
        raise CheckNotApplicable(f"not judged: none of the {len(found)} states this check can draw can be rebuilt "
                                 f"offline (e.g. before op #{found[0]}: {left[found[0]]}); this says nothing of the "
                                 "trainer")
    # Half the draws go to states where retention holds all it keeps (the early saves of a run cannot
    # show a restore point deleted before its time), latest first: the simplest example Hypothesis
    # tries is then the last state before a commit, by which any early deletion has happened. The
    # other half go to any state.
    full = _steady_states(baseline, param)
    return st.one_of(st.sampled_from(full), st.sampled_from(found)) if full else st.sampled_from(found)


_STEADY: dict[tuple[int, str], tuple[RecordedRun, list[int]]] = {}


def _steady_states(run: RecordedRun, param: str) -> list[int]:
    key = (id(run), _MODEL[param])
    if key not in _STEADY or _STEADY[key][0] is not run:
        _STEADY[key] = (run, retained.steady(run, usable_states(run, param))[::-1])
    return _STEADY[key][1]


def compound_faults(session: Session, check: str, spec: RunSpec, param: str, before) -> None:
    run = session.baseline(spec)
    if run.unreplayable:
        raise StateNotRebuilt(f"the recorded run cannot be replayed offline: {run.unreplayable}")
    usable = usable_states(run, param)
    before = int(before) if before is not None else usable[0]
    if before not in usable:   # a replayed label from another run of a trainer that changed since
        shown = ", ".join(map(str, usable[:8])) + (" ..." if len(usable) > 8 else "")
        raise CrashPointMissing(f"op #{before} is not a state this check can build here (a fault inside a save after "
                                f"a committed one); the states of this run: {shown or 'none'}")
    try:
        built = retained.compound_state(run, _MODEL[param], before)
    except UnreplayableTrace as exc:
        raise StateNotRebuilt(f"the state before op #{before} cannot be rebuilt offline: {exc}") from None
    if built is None:
        raise CrashPointMissing(f"before op #{before} no committed checkpoint is left intact to damage")
    state, files, dirs, links = built
    d = session.case_dir("compound")
    ckpt, log = (d / "ckpt").resolve(), (d / "loss.jsonl").resolve()
    retained.materialize(files, dirs, links, ckpt)
    probe = spec.but(total_steps=min(spec.total_steps, max(state.damaged, state.in_progress or 0) + 1))
    result = session.runner.run_process(session.adapter, probe, ckpt, log)
    fault = "a kill" if state.model == "kill" else "a power cut (unsynced data lost)"
    where = (f"  fault: {fault} before op #{before} ({run.role(before)}), then the checkpoint of step "
             f"{state.damaged} damaged: {', '.join(state.files[:4])}{' ...' if len(state.files) > 4 else ''} "
             f"truncated to half\n  retention had kept beside step {state.damaged}: "
             + (f"step {state.promised}" if state.promised else "nothing older (it keeps one checkpoint)") + "\n")
    r = result.resumed_from(probe)
    evidence.record(evidence.Fault(check=check, point=f"op #{before}", planned=run.role(before),
                                   fault=f"{fault}, then step {state.damaged} damaged", first_exit=-9,
                                   went_on=False, resumed_from=r, final_exit=result.returncode))
    problem = judge(state, result.returncode, result.losses, r, run.losses, session.tolerance(spec), probe.total_steps,
                    lambda step, losses: session.same_as_plain_resume(spec, step, losses))
    if problem:
        raise session.fail(check, spec, problem, details=where + "  stderr:\n" + stderr_tail(result.stderr),
                           case={"state": state.label})


def judge(state: retained.CompoundState, returncode: int, losses: dict[int, float], r: int,
          baseline: dict[int, float], tol: float, probe_total: int, same_as_plain) -> str | None:
    """What went wrong, or None; a pure function of the state and the resumed process."""
    early = (f"retention had deleted the checkpoint of step {state.promised}, which it kept beside step "
             f"{state.damaged} in the uninterrupted run, before the save of step {state.in_progress} was complete")
    if state.missing:
        gone = ", ".join(f"step {s}" for s in state.missing)
        return (f"retention had deleted (or left damaged) the checkpoint(s) of {gone}, which it keeps beside step "
                f"{state.damaged} in the uninterrupted run, while the save of step {state.in_progress} was not yet "
                "committed: in this state the trainer holds fewer restore points than its own retention promises "
                "(it makes room before writing instead of deleting after the commit)")
    if returncode != 0:
        # Stopping loudly on a damaged checkpoint is allowed (as in corruption_detected), provided
        # what retention promised is still there for whoever restarts it.
        if state.promised and not state.promised_intact and not state.in_progress_whole:
            return f"the next start exited {returncode}: {early}, so nothing intact was left to fall back to"
        return None
    if not losses:
        if state.in_progress_whole and state.in_progress and state.in_progress >= probe_total:
            return None
        return (f"the next start exited 0 without training: it resumed from a step at or past {probe_total} "
                f"(the damaged checkpoint of step {state.damaged}?)")
    if r < state.promised:
        if not state.promised_intact:
            return f"the next start resumed {resumed_from(r)}: {early}"
        return (f"the next start resumed {resumed_from(r)}, though the checkpoint of step {state.promised}, which "
                f"retention kept beside step {state.damaged}, was intact: it skipped it")
    rows = loss_mismatches(baseline, losses, tol)
    if rows and not (r > 0 and same_as_plain(r, losses)):
        return (f"the next start resumed {resumed_from(r)} and diverges: it loaded the damaged or an incomplete "
                "checkpoint\n  first differing steps:\n" + format_mismatches(rows))
    return None
