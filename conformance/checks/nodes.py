"""node_loss in a job of several nodes with node-local storage: node K is lost whole (its agent
and ranks at once, at a point of its first rank) and its directory with it, as a machine and its
local disk are; the next job must resume from what survives (a replica on another node, the
shared directory, the cold tier) and match every rank's uninterrupted curve.

Replication may lag one save, as uploads to a cold tier may (checks/tiers.py): the resume must
come from at least the save before the newest one committed when the node was lost (0 if none).
Starting over, or resuming from a state that is missing the lost node's part, fails.
"""
from __future__ import annotations

from ..faults.scenario import CrashPointMissing
from ..model import evidence
from ..model.crash import CrashPoint
from ..model.process import RunSpec
from .common import resumed_from
from .failures import describe_ranks, rank_mismatches, stderr_tail
from .schedules import describe_crashes, fail_trial, trial
from .session import Session


def node_loss(session: Session, check: str, spec: RunSpec, _param, point: CrashPoint) -> None:
    if not point.whole_node:
        raise CrashPointMissing(f"{point} kills one rank: node_loss with node-local storage loses a whole node, "
                                "written '@nodeK'")
    outcome = trial(session, check, spec, (point,))
    crash, final = outcome.crashed[0], outcome.final
    base = session.baseline(spec)
    committed = [s for s in base.saves() if s <= crash.kill.newest_committed]
    bound = committed[-2] if len(committed) >= 2 else 0
    lost = f"node {point.node} was lost with its directory"
    details = describe_crashes(outcome)

    def fail(problem: str, more: str = ""):
        return fail_trial(session, check, outcome, problem, details + more, case="lost_at")

    if final.returncode != 0:
        raise fail(f"after {lost}, the next job exited {final.returncode}",
                   "\n  stderr:\n" + stderr_tail(final.stderr))
    split = final.ranks_disagree()
    if split:
        raise fail(f"after {lost}, the ranks resumed from different checkpoints: {split}")
    r = crash.resumed_from
    if r < bound:
        raise fail(f"after {lost}, the next job resumed {resumed_from(r)}; the save of step {bound} had been "
                   f"committed before the newest ({committed[-1]}), so a copy of node {point.node}'s part should "
                   "have survived elsewhere (a replica on another node, the shared directory, the cold tier)")
    bad = rank_mismatches(base.result, final, session.tolerance(spec))
    if bad and r > 0 and session.same_as_plain_resume(spec, r, final.losses):
        evidence.record(evidence.Note(f"the curve after resuming from step {r} diverges exactly as a plain resume "
                                      "from that checkpoint does: a resume problem, not the node loss"))
        return
    if bad:
        raise fail(f"after {lost}, the job resumed from step {r} and rank(s) {', '.join(str(k) for k, _ in bad)} "
                   "left their curve: they did not get the lost node's state back (a rank started without its "
                   "state, or from another step's copy)", "\n" + describe_ranks(bad, spec.world_size))
