"""Checks only a multi-rank trainer has: every rank resumes at the same step on its own curve
(rank_resume), a checkpoint is used only if every rank finished it (all_or_nothing), and a
checkpoint saved by one world size resumes on another (reshard).

Every rank's curve is compared with the same rank's curve in the uninterrupted job, so a rank
whose RNG or data position was not restored is named even when rank 0 is fine.
"""
from __future__ import annotations

from ..faults.delivery import CrashNotLanded, choose_route
from ..faults.scenario import plan, what_is_there
from ..model import evidence
from ..model.crash import CrashPoint
from ..model.process import RunSpec, rank_log
from ..run.runners import Tracing
from ..trace import recording
from .failures import describe_ranks, format_mismatches, loss_mismatches, max_abs_diff, rank_mismatches, stderr_tail
from .schedules import describe_crashes, trial
from .schedules import fail_trial as _fail_trial
from .session import Session
from .tolerance import capped


def fail_trial(*args, **kwargs):
    """A failure of a one-point check: its replay line names the point (`--point`)."""
    return _fail_trial(*args, case="point", **kwargs)


def rank_resume(session: Session, check: str, spec: RunSpec, _param, point: CrashPoint) -> None:
    """One rank killed at a step boundary: every rank resumes from the same step and every rank's
    curve matches its own curve in the uninterrupted job."""
    outcome = trial(session, check, spec, (point,))
    final = outcome.final
    if final.returncode != 0:
        raise fail_trial(session, check, outcome, f"after {point.stopped()} the next job exited "
                    f"{final.returncode}", describe_crashes(outcome) + "\n  stderr:\n" + stderr_tail(final.stderr))
    split = final.ranks_disagree()
    if split:
        raise fail_trial(session, check, outcome, f"the ranks resumed from different steps: {split}",
                    describe_crashes(outcome))
    bad = rank_mismatches(session.baseline(spec).result, final, session.tolerance(spec))
    if bad:
        raise fail_trial(session, check, outcome,
                    f"after resuming from step {outcome.final_resumed_from}, rank(s) "
                    f"{', '.join(str(r) for r, _ in bad)} left their own uninterrupted curve (a rank's RNG or "
                    "data position not saved or not restored looks like this)",
                    describe_crashes(outcome) + "\n" + describe_ranks(bad, spec.world_size))


def all_or_nothing(session: Session, check: str, spec: RunSpec, _param, point: CrashPoint) -> None:
    """One rank killed inside a save: the next start uses only a checkpoint every rank finished,
    every rank from the same one, and every rank's curve matches."""
    outcome = trial(session, check, spec, (point,))
    crash, final = outcome.crashed[0], outcome.final
    split = final.ranks_disagree()
    if split:
        raise fail_trial(session, check, outcome, f"the ranks resumed from different checkpoints: {split}",
                    describe_crashes(outcome))
    r = crash.resumed_from
    if r < 0:
        complete = (f"the checkpoint of step {crash.kill.newest_committed} was complete on every rank"
                    if crash.kill.newest_committed else "no checkpoint was complete, so it should have started fresh")
        raise fail_trial(session, check, outcome,
                    f"after {point.stopped()} inside the save of step {crash.kill.in_progress}, the "
                    f"next job could not start (exit {final.returncode}); {complete}",
                    describe_crashes(outcome) + "\n  stderr:\n" + stderr_tail(final.stderr))
    allowed = crash.kill.allowed_resumes()
    if r > 0 and r not in allowed and r > crash.kill.newest_committed:
        raise fail_trial(session, check, outcome,
                    f"the next job resumed from step {r}, a checkpoint not every rank had finished before "
                    f"{point.stopped()} (complete then: step {crash.kill.newest_committed})",
                    describe_crashes(outcome))
    bad = rank_mismatches(session.baseline(spec).result, final, session.tolerance(spec))
    if bad and r > 0 and session.same_as_plain_resume(spec, r, final.losses):
        evidence.record(evidence.Note(f"the curve after resuming from step {r} diverges exactly as a plain resume "
                                      "from that checkpoint does: a resume problem, not a mixed checkpoint"))
        return
    if bad:
        raise fail_trial(session, check, outcome,
                    f"after {point.stopped()} inside the save of step {crash.kill.in_progress}, the "
                    f"job resumed from step {r} and rank(s) {', '.join(str(k) for k, _ in bad)} left their curve: "
                    "it loaded state not every rank had committed (a mix of two steps' shards looks like this)",
                    describe_crashes(outcome) + "\n" + describe_ranks(bad, spec.world_size))


def _middle_save(spec: RunSpec) -> int:
    saves = list(range(spec.save_every, spec.total_steps, spec.save_every))
    return saves[len(saves) // 2] if saves else 0


def reshard(session: Session, check: str, spec: RunSpec, direction: str, _case) -> None:
    """Save with one world size and resume with another (`shrink`: W ranks, then 1; `grow`: 1,
    then W): the job resumes at the saved step and the global loss stays on the baseline."""
    base = session.baseline(spec)
    saved_w, resumed_w = (spec.world_size, 1) if direction == "shrink" else (1, spec.world_size)
    step = _middle_save(spec)
    if not step:
        return
    workdir = session.case_dir("reshard")
    ckpt = workdir / "ckpt"
    ckpt.mkdir()
    first_spec = spec.but(world_size=saved_w, torchrun=True, nnodes=spec.nnodes if saved_w > 1 else 1)
    # Rank 0 killed as it logs the step after `done` (`step:done@r0`): one step after the baseline
    # had the save of `step` committed on every rank (at once for a save done before the next step
    # is logged; later for one in flight across steps: learned from the recording). It lands on the
    # rank's loss log as every step point does (delivery.choose_route), and is proven to below.
    done = next((k for k in range(step, spec.total_steps) if base.committed_by_step(k) >= step), step) + 1
    log = workdir / "first-loss.jsonl"
    point, planned = CrashPoint("step", done, rank=0), base.rank_view(0)
    kill = plan(point, base)
    if kill is None:
        raise CrashNotLanded(f"crash point {point} does not exist in the uninterrupted run ({what_is_there(base, point)})")
    route = choose_route(kill, planned, frozenset(), ckpt, rank_log(log, 0, saved_w), job=True)
    tracing = Tracing.each(first_spec, workdir / "first.strace", lambda f: route.argv(f, kill), ranks=[0])
    first = session.runner.run_process(session.adapter, first_spec, ckpt, log, tracing=tracing)
    landed = recording.from_result(first, first_spec, ckpt.resolve(), log.resolve()).rank_view(0)
    how = f"saved by {saved_w} rank(s) at step {step}, resumed by {resumed_w}"
    # Another world size sums the global batch in another order: the noise two runs of one shape
    # show says nothing about it, so these comparisons keep the cap.
    tol = capped(session.cap, "another world size reduces the global batch in another order, so its floating-point "
                 "sums differ from the W-rank run's")
    rows = loss_mismatches(base.losses, first.losses, tol)
    if rows or max(first.losses, default=0) < done:
        raise session.fail(check, spec, f"with {saved_w} rank(s) the global loss is not the {spec.world_size}-rank "
                           "run's (does the trainer keep the global batch fixed across world sizes?)"
                           if rows else f"the {saved_w}-rank job did not reach step {done} (exit "
                           f"{first.returncode})",
                           details=("  first differing steps:\n" + format_mismatches(rows)) if rows else
                           "  stderr:\n" + stderr_tail(first.stderr))
    route.check(kill, planned, landed, first)   # CrashNotLanded: the resume below would not say what it seems to
    second_spec = spec.but(world_size=resumed_w, torchrun=True, nnodes=spec.nnodes if resumed_w > 1 else 1)
    second = session.runner.run_process(session.adapter, second_spec, ckpt, workdir / "second-loss.jsonl")
    r = second.resumed_from(spec)
    evidence.record(evidence.Note(f"reshard[{direction}]: {how}: exit {second.returncode}, resumed from step {r}, "
                                  f"max |diff| {max_abs_diff(base.losses, second.losses)}"))
    if second.returncode != 0:
        raise session.fail(check, spec, f"{how}: the {resumed_w}-rank job exited {second.returncode}",
                           details="  stderr:\n" + stderr_tail(second.stderr))
    if r != step:
        raise session.fail(check, spec, f"{how}: the {resumed_w}-rank job resumed from "
                           + ("scratch" if r == 0 else f"step {r}") + f", not step {step}",
                           details="  stderr:\n" + stderr_tail(second.stderr))
    rows = loss_mismatches(base.losses, second.losses, tol)
    if rows:
        raise session.fail(check, spec, f"{how}: the global loss differs from the uninterrupted run at {len(rows)} "
                           f"step(s) (tolerance {tol.describe()}); optimizer or per-rank state was not resharded",
                           details="  first differing steps:\n" + format_mismatches(rows))
