"""Checks decided by crash trials: kill the trainer at drawn points, resume, judge.

resume_matches_baseline, no_lost_work and no_torn_state share the trial (scenario.py) and differ in
what they judge; each judge is a pure function of the trial's outcome.
"""
from __future__ import annotations

from ..faults.scenario import TrialOutcome, run_schedule
from ..model import evidence
from ..model.crash import Schedule, format_schedule
from ..model.process import RunSpec
from .common import plot_mismatch, resumed_from
from .diagnosis import diagnose
from .failures import describe_ranks, format_mismatches, loss_mismatches, max_abs_diff, rank_mismatches, stderr_tail
from .session import Session


def run_trial(session: Session, spec: RunSpec, schedule: Schedule) -> TrialOutcome:
    return run_schedule(session.runner, session.adapter, spec, schedule, session.case_dir("trial"),
                        session.baseline(spec), session.stable_paths(spec))


def _plot_trial(session: Session, check: str, outcome: TrialOutcome) -> str:
    resumed = [(f"process 1 (killed at {outcome.crashed[0].point})", outcome.crashed[0].result.losses),
               *outcome.all_losses()]
    crashes = [(str(c.point), max(c.result.losses, default=max(c.started_from, 0)) + 0.5) for c in outcome.crashed]
    return plot_mismatch(session, check, outcome.spec, schedule=outcome.schedule, resumed=resumed,
                         crashes=crashes, resumes=[c.resumed_from for c in outcome.crashed])


def _record_trial(session: Session, check: str, outcome: TrialOutcome) -> None:
    base = session.baseline(outcome.spec).losses
    compared, worst, rows = 0, None, []
    for _, losses in outcome.all_losses():
        compared += len(losses)
        d = max_abs_diff(base, losses)
        if d is not None:
            worst = d if worst is None else max(worst, d)
        rows += loss_mismatches(base, losses, session.tolerance(outcome.spec).value)
    evidence.record(evidence.Trial(
        check=check, schedule=format_schedule(outcome.schedule), spec=outcome.spec.describe(),
        crashes=tuple(evidence.CrashRecord(str(c.point), c.kill.text, c.kill.in_progress, c.kill.newest_committed,
                                           c.resumed_from) for c in outcome.crashed),
        final_exit=outcome.final.returncode, steps_compared=compared, max_abs_diff=worst,
        tolerance=session.tolerance(outcome.spec).value, mismatches=evidence.mismatch_rows(rows[:10])))


def describe_crashes(outcome: TrialOutcome) -> str:
    lines = []
    for i, c in enumerate(outcome.crashed):
        where = f"inside the save of step {c.kill.in_progress}" if c.kill.in_progress else "outside any save"
        r = c.resumed_from
        resumed = f"next process resumed from step {r}" if r >= 0 else "next process did not resume"
        how = (f"node {c.point.node} lost (its agent and every rank on it killed at once) on entry to {c.kill.text}"
               if c.point.whole_node else f"kill on entry to {c.kill.text}")
        lines.append(f"  crash {i + 1}: {c.point} = {how} ({where}); "
                     f"newest committed checkpoint then: step {c.kill.newest_committed}; {resumed}")
    return "\n".join(lines)


def trial(session: Session, check: str, spec: RunSpec, schedule: Schedule) -> TrialOutcome:
    """Run one schedule and record its evidence (the judges below decide it)."""
    outcome = run_trial(session, spec, schedule)
    _record_trial(session, check, outcome)
    return outcome


def fail_trial(session: Session, check: str, outcome: TrialOutcome, problem: str, details: str, *,
               case: str = "schedule"):
    """The failure of a trial; `case` names the replay option its schedule goes in (`point` for a
    check that takes one point)."""
    schedule = format_schedule(outcome.schedule)
    return session.fail(check, outcome.spec, problem, schedule=schedule, details=details,
                        case={case: schedule})


def resume_matches_baseline(session: Session, check: str, spec: RunSpec, _param, schedule: Schedule) -> None:
    """After any crash schedule the run finishes (exit 0) on the uninterrupted loss curve."""
    outcome = trial(session, check, spec, schedule)
    base = session.baseline(spec)
    if outcome.final.returncode != 0:
        raise fail_trial(session, check, outcome,
                    f"the resumed run exited {outcome.final.returncode} after a plain kill (an in-place "
                    "or torn write looks like this from outside)",
                    describe_crashes(outcome) + "\n  stderr of the resumed run:\n" + stderr_tail(outcome.final.stderr))
    for i, (who, losses) in enumerate(outcome.all_losses()):
        rows = loss_mismatches(base.losses, losses, session.tolerance(spec))
        if rows:
            what = (f"{rows.state.describe()}, though its losses match the uninterrupted run's" if rows.state_only
                    else f"loss differs from the uninterrupted run at {len(rows)} step(s)")
            raise fail_trial(session, check, outcome, f"{who}: {what} (tolerance {rows.tolerance.describe()})",
                        describe_crashes(outcome) + "\n  first differing steps:\n" + format_mismatches(rows)
                        + "\n" + _likely_cause(session, spec, outcome.crashed[i].resumed_from, losses)
                        + "\n" + _plot_trial(session, check, outcome))
    bad = rank_mismatches(base.result, outcome.final, session.tolerance(spec))
    if bad:   # the global curve can hide a rank; each rank is compared with its own
        raise fail_trial(session, check, outcome,
                    f"rank(s) {', '.join(str(r) for r, _ in bad)} left their own uninterrupted curve after "
                    f"resuming from step {outcome.final_resumed_from}",
                    describe_crashes(outcome) + "\n" + describe_ranks(bad, outcome.spec.world_size))
    last = max([s for _, l in outcome.all_losses() for s in l] + [outcome.final_resumed_from])
    if last < spec.total_steps:
        raise fail_trial(session, check, outcome, f"the resumed run stopped at step {last}, not {spec.total_steps}",
                    describe_crashes(outcome))


def _likely_cause(session: Session, spec: RunSpec, resumed_from: int, losses: dict[int, float]) -> str:
    if session.verdict_only:
        return "  likely cause: not looked for (a confirmation replay)"
    try:
        return diagnose(session, spec, resumed_from, losses).render()
    except Exception as exc:   # an experiment that breaks must not hide the verdict
        return f"  likely cause: cannot tell (the experiments failed: {exc!r})"


def no_lost_work(session: Session, check: str, spec: RunSpec, _where, schedule: Schedule) -> None:
    """After each crash the trainer resumes from the newest checkpoint committed before the kill."""
    outcome = trial(session, check, spec, schedule)
    for i, c in enumerate(outcome.crashed):
        r, newest = c.resumed_from, c.kill.newest_committed
        if r < 0:
            continue  # the next process never trained: judged by resume_matches_baseline / no_torn_state
        if r < newest:
            what = resumed_from(r)
            raise fail_trial(session, check, outcome, f"after crash {i + 1} the trainer resumed {what}, but the "
                        f"checkpoint of step {newest} was committed before the kill", describe_crashes(outcome))
        upper = max(c.kill.allowed_resumes())   # in a job, also a save the other ranks committed after the kill
        if r > upper:
            raise fail_trial(session, check, outcome, f"after crash {i + 1} the trainer resumed from step {r}, later "
                        f"than any checkpoint that could have been written before the kill (step {upper})",
                        describe_crashes(outcome))


def no_torn_state(session: Session, check: str, spec: RunSpec, _param, schedule: Schedule) -> None:
    """After a kill inside a save, the checkpoint the next process resumes from is complete."""
    outcome = trial(session, check, spec, schedule)
    base = session.baseline(spec)
    processes = [c.result for c in outcome.crashed[1:]] + [outcome.final]
    for i, c in enumerate(outcome.crashed):
        if not c.kill.in_progress:
            continue
        nxt, r = processes[i], c.resumed_from
        if r < 0 or (not nxt.losses and nxt.returncode not in (0, -9, 137)):
            raise fail_trial(session, check, outcome,
                        f"after a kill inside the save of step {c.kill.in_progress} the trainer could not "
                        f"resume (exit {nxt.returncode}): it found a torn checkpoint",
                        describe_crashes(outcome) + "\n  stderr:\n" + stderr_tail(nxt.stderr))
        if r not in c.kill.allowed_resumes():
            continue  # lost work, judged by no_lost_work
        rows = loss_mismatches(base.losses, nxt.losses, session.tolerance(spec))
        if rows and r > 0 and session.same_as_plain_resume(spec, r, nxt.losses):
            evidence.record(evidence.Note(f"crash {i + 1}: the curve after resuming from step {r} diverges "
                                          "exactly as a plain resume from that checkpoint does: whole "
                                          "checkpoint, a resume_matches_baseline problem"))
            continue
        if rows:
            raise fail_trial(session, check, outcome,
                        f"after a kill inside the save of step {c.kill.in_progress} the trainer resumed from "
                        f"step {r} and its losses differ: it loaded incomplete state",
                        describe_crashes(outcome) + "\n  first differing steps:\n" + format_mismatches(rows)
                        + "\n" + _plot_trial(session, check, outcome))
