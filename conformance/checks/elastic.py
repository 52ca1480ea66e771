"""elastic_restart: a job launched with torchrun's `--max-restarts=1` has one rank killed inside a
save; torchrun's agent then stops the other workers and starts the whole group again in place,
with no new job from the suite. What is tested is the trainer's own restart logic: the restarted
workers (TORCHELASTIC_RESTART_COUNT=1) must resume like any start does, from at least the newest
checkpoint every rank had committed before the kill, every rank from the same one, on their own
uninterrupted curves, and the job must end with exit 0.

The restarted workers log to the same loss logs as the killed ones, after a line the suite's rank
entry point writes when a restarted worker starts (process.mark_restart; a step going back would
not do: a restart may resume at the very step the kill came after). The fault is planned,
delivered and proven on the first attempt only (the restarted workers run untraced, run/rank.py).
"""
from __future__ import annotations

from ..faults import strategies
from ..faults.injection import run_fault
from ..faults.scenario import CrashPointMissing
from ..model import evidence
from ..model.crash import CrashPoint
from ..model.process import ProcessResult, RunSpec, mean_curve, read_attempts
from .common import resumed_from
from .failures import CheckNotApplicable, describe_ranks, rank_mismatches, stderr_tail
from .session import Session

RESTARTS = 1
MULTI_NODE = ("restarts in place of a job of several nodes are not judged: after a restart, ranks of the other "
              "node failed now and then to reach the new attempt's store (TCPStore, 1 soak run in 2 here), which a "
              "correct trainer cannot prevent; run it with --nnodes=1")


def restart_points(baseline):
    """Where a rank is killed: in-save points of every rank, each save from its end (as
    all_or_nothing); CheckNotApplicable for a job of several nodes (MULTI_NODE)."""
    if baseline.spec.nnodes > 1:
        raise CheckNotApplicable(MULTI_NODE)
    return strategies.save_end_points(baseline)


def elastic_restart(session: Session, check: str, spec: RunSpec, _param, point: CrashPoint) -> None:
    if point.whole_node:
        raise CrashPointMissing(f"{point} loses a whole node: elastic_restart kills one rank, written '@rN'")
    if spec.nnodes > 1:
        raise CheckNotApplicable(MULTI_NODE)
    base = session.baseline(spec)
    outcome = run_fault(session.runner, session.adapter, spec, point, "signal=KILL", session.case_dir("elastic"),
                        base, faulted_spec=spec.but(max_restarts=RESTARTS), stable=session.stable_paths(spec),
                        then_start=False)
    kill, job = outcome.planned, outcome.first
    attempts = [read_attempts(outcome.log, q, spec.world_size) for q in range(spec.world_size)]
    restarted = tuple(a[1] if len(a) > 1 else {} for a in attempts)
    firsts = {q: (min(c) - 1 if c else None) for q, c in enumerate(restarted)}
    known = {f for f in firsts.values() if f is not None}
    r = min(known) if known else (spec.total_steps if job.returncode == 0 else -1)
    where = (f"  fault: SIGKILL on entry to {kill.text}"
             + (f", inside the save of step {kill.in_progress}" if kill.in_progress else "")
             + f"; newest committed checkpoint then: step {kill.newest_committed}; torchrun --max-restarts={RESTARTS}\n")
    evidence.record(evidence.Fault(check=check, point=str(point), planned=kill.text, fault="SIGKILL, restart in place",
                                   first_exit=job.returncode, went_on=False, resumed_from=r,
                                   final_exit=job.returncode))

    def fail(problem: str, details: str = ""):
        return session.fail(check, spec, problem, details=where + details, case={"point": str(point)})

    if job.returncode != 0:
        raise fail(f"after torchrun restarted the workers in place, the job exited {job.returncode}",
                   "  stderr:\n" + stderr_tail(job.stderr))
    if len(known) > 1:
        who = ", ".join(f"rank {q} from step {f}" for q, f in firsts.items() if f is not None)
        raise fail(f"the restarted workers resumed from different steps: {who}")
    if r < kill.newest_committed:
        raise fail(f"the restarted workers resumed {resumed_from(r)}, though the checkpoint of step "
                   f"{kill.newest_committed} was committed before the kill: the restart does not look for the "
                   "newest checkpoint the way a new job does")
    allowed = kill.allowed_resumes()
    if r > kill.newest_committed and r not in allowed:
        raise fail(f"the restarted workers resumed from step {r}, a checkpoint not every rank had finished before "
                   f"the kill (complete then: step {kill.newest_committed})")
    again = ProcessResult(job.returncode, {}, job.stderr, rank_losses=restarted)
    bad = rank_mismatches(base.result, again, session.tolerance(spec))
    if bad and r > 0 and session.same_as_plain_resume(spec, r, mean_curve(restarted)):
        evidence.record(evidence.Note(f"the restarted curve from step {r} diverges exactly as a plain resume from "
                                      "that checkpoint does: a resume problem (resume_matches_baseline's), not the "
                                      "restart's"))
        return
    if bad:
        raise fail(f"the restarted workers resumed from step {r} and rank(s) {', '.join(str(k) for k, _ in bad)} "
                   "left their uninterrupted curve", describe_ranks(bad, spec.world_size))


