"""power_loss[data|strict]: the state a power cut before each recorded operation leaves, under
two persistence models (powerloss.py), each decided by a short resume.

In each state the trainer must:
- never load bad data: its next steps match the baseline, or it exits non-zero with a message;
- never crash-loop while an intact checkpoint exists;
- keep durable saves: resume from at least the newest checkpoint whose save had completed before
  the cut. A save has completed when the trainer logged the next step: it has moved on, believing
  the save safe.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..model import evidence
from ..model.process import ProcessResult, RunSpec
from ..offline import powerloss
from ..offline.crash_states import CrashState, distinct, probe_specs, same_directory_note, save_files
from ..offline.unseen import DirectoryView
from ..trace.recording import UnreplayableTrace
from .common import resumed_from
from .failures import CheckNotApplicable, loss_mismatches, stderr_tail
from .session import Session
from .states import (
    MAX_STATE_FAILURES,
    decide_states,
    left_out_reasons,
    looked_at,
    not_judged,
    observed_run,
    resumed_past,
)
from .tolerance import Tolerance


@dataclasses.dataclass(frozen=True)
class PowerState:
    before: int
    description: str
    completed: int               # newest save completed (next step logged) before the cut
    in_progress: int | None
    intact: tuple[int, ...]      # saves whose every file survives the cut with its bytes
    lost: str                    # what the cut lost of the completed save, for messages
    content: str = ""            # digest of the directory the cut leaves
    view: DirectoryView | None = dataclasses.field(default=None, compare=False, repr=False)
    left_out: str = ""           # why this state cannot be rebuilt ("" when it can): it is not decided

    @property
    def verdict_key(self) -> tuple:
        return (self.content or self.label, self.completed, self.in_progress, self.intact)

    @property
    def label(self) -> str:
        return str(self.before)


def _what_was_lost(cut: powerloss.Cut, files: dict[str, bytes]) -> str:
    reasons = []
    for path, data in sorted(files.items()):
        if path not in cut.files:
            parent = next((why for p, why in cut.lost_entries.items() if path == p or path.startswith(p + "/")), None)
            reasons.append(f"`{path}` is missing: " + (parent or "its directory entry did not persist"))
        elif cut.files[path] != data:
            left = cut.files[path]
            size = (f"{len(left)} of {len(data)} bytes left" if len(left) != len(data) else
                    "full length, but zeros where its unsynced data was")
            reasons.append(f"`{path}`: " + (f"{cut.lost_data[path]}" if path in cut.lost_data else "holds other bytes")
                           + f" ({size})")
    return "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")


def power_states(session: Session, spec: RunSpec, model: str) -> tuple[list[PowerState], dict[int, powerloss.Cut]]:
    run = session.baseline(spec)
    finals = save_files(run)
    states, cuts = [], {}
    for i, cut in powerloss.cuts(run, model):
        view = cut.view()
        intact = tuple(s for s, files in sorted(finals.items())
                       if files and all(cut.files.get(p) == b for p, b in files.items()))
        completed = run.committed_before(i)
        lost = _what_was_lost(cut, finals.get(completed, {})) if completed and completed not in intact else ""
        op = run.ops[i]
        states.append(PowerState(i, f"power cut before op #{i} ({run.role(i)}: {op.describe()})", completed,
                                 run.in_progress(i), intact, lost, view.key, view, cut.left_out))
        cuts[i] = cut
    return states, cuts


def judge_power_state(state: PowerState, result: ProcessResult, baseline: dict[int, float], tol: Tolerance,
                      last: int) -> str | None:
    """None if the trainer resumed correctly after this power cut, else what went wrong (`last`: the
    probe's final step)."""
    c = state.completed
    durable = (f"the save of step {c} had completed (step {c + 1} was logged) before the power cut"
               + (f"; {state.lost}" if state.lost else ""))
    if result.returncode != 0:
        if state.intact:
            return (f"the trainer exited {result.returncode} although the checkpoint of step {max(state.intact)} "
                    "is intact: it would crash-loop instead of falling back" + (f" ({durable})" if c else ""))
        if c:
            return f"{durable}, and the trainer could not resume (exit {result.returncode})"
        return None if result.stderr.strip() else f"the trainer exited {result.returncode} without a message"
    if result.first_step is None:
        if max(state.intact, default=0) >= last:
            return None   # the final step's checkpoint is intact: nothing is left to train
        return "the trainer exited 0 without training: it resumed from a step later than any checkpoint on disk"
    resumed = result.first_step - 1
    if resumed < c:
        what = resumed_from(resumed)
        return f"{durable}; after it the trainer resumed {what}"
    bad = loss_mismatches(baseline, result.losses, tol)
    if bad:
        return (f"the trainer resumed from step {resumed} but {bad.first_problem(baseline)}: it loaded data the "
                "power cut had damaged")
    return None


def decide_power_state(session: Session, spec: RunSpec, state: PowerState, cut: powerloss.Cut, directory: Path,
                       observe: bool = True) -> tuple[str | None, ProcessResult, frozenset[str] | None]:
    run = session.baseline(spec)
    ckpt, log = (directory / "ckpt").resolve(), (directory / "loss.jsonl").resolve()
    newest = max(state.intact + (state.completed,))
    probe_state = CrashState(state.before, False, state.description, newest,
                             state.in_progress if state.in_progress and state.in_progress > newest else None)
    named = []
    for probe in probe_specs(spec, probe_state):
        cut.materialize(ckpt)
        log.unlink(missing_ok=True)
        result, more = observed_run(session, probe, ckpt, log, observe)
        named.append(more)
        if not resumed_past(result):
            break
    problem = judge_power_state(state, result, run.losses, session.tolerance(spec), probe.total_steps)
    if problem and result.returncode == 0 and result.first_step and result.first_step - 1 >= state.completed \
            and session.same_as_plain_resume(spec, result.first_step - 1, result.losses):
        problem = None   # whole checkpoint: any divergence is resume_matches_baseline's
    return problem, result, looked_at(state, named, ckpt)


def power_loss(session: Session, check: str, spec: RunSpec, model: str, only: str | None = None) -> int:
    """Every state a power cut can leave during one recorded run, under `model`; returns how many were
    decided. States that cannot be rebuilt are left out and counted; with every state left out, it
    is not judged."""
    try:
        states, cuts = power_states(session, spec, model)
    except UnreplayableTrace as exc:
        run = session.baseline(spec)
        evidence.record(evidence.PowerLoss(model=model, states=len(run.mutations), failed=0, left_out=len(run.mutations),
                                           left_out_reasons=(str(exc),)))
        raise CheckNotApplicable(f"not judged: the recorded run cannot be replayed offline ({exc}), so no power-loss "
                                 "state can be rebuilt; this says nothing of the trainer") from None
    if only is not None:
        states = [s for s in states if s.label == only]
        if not states:
            raise CheckNotApplicable(f"no power-loss state {only!r} in this run: labels are op numbers")
    left = [(s, s.left_out) for s in states if s.left_out]
    same = distinct([s for s in states if not s.left_out])
    directories = len(same)   # cuts that leave the same directory, judged alike, are decided once
    shared = session.resumes_shared
    failures = decide_states(session, f"power-{model}", "power", same,
                             lambda state, d, observe: decide_power_state(session, spec, state, cuts[state.before], d,
                                                                          observe), left)
    evidence.record(evidence.PowerLoss(model=model, states=len(states), failed=len(failures),
                                       failing=tuple(s.label for s, _, _ in failures), distinct=directories,
                                       resumed=len(same), shared=session.resumes_shared - shared,
                                       left_out=len(left), left_out_reasons=left_out_reasons(left)))
    if not same and left:
        raise not_judged("power-loss states", left)
    if failures:
        state, problem, result = failures[0]
        problem += same_directory_note(same[state], "power cuts before ops")
        others = "".join(f"\n    state {s.label}: {s.description}: {p}" for s, p, _ in failures[1:])
        raise session.fail(
            check, spec, f"after a {state.description}, {problem}",
            details=f"  model: {model} ("
                    + ("unsynced data lost" if model == "data" else "unsynced data and unsynced directory entries lost") + ")"
                    f"\n  intact checkpoints in that state: {', '.join(f'step {s}' for s in state.intact) or 'none'}"
                    + f"\n  stderr:\n{stderr_tail(result.stderr)}"
                    + (f"\n  other failing states (first {MAX_STATE_FAILURES}):{others}" if others else ""),
            case={"state": state.label})
    return len(states) - len(left)
