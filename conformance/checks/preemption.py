"""preemption: a scheduler's SIGTERM at a step boundary or inside a save, SIGKILL after the grace
period if the trainer is still running (SLURM's KillWait, Kubernetes' terminationGracePeriod),
then a fresh start.

- Whatever the trainer does on SIGTERM (nothing, save and exit, finish the current save and
  exit), the next start resumes correctly: from at least the newest committed checkpoint, on the
  baseline's curve.
- Exiting 0 on SIGTERM before TOTAL_STEPS is a failure: Kubernetes marks such a Job Completed and
  never restarts the training.
- With capability `preemption_save` (the trainer says it saves on SIGTERM): it exits within the
  grace period, and the next start resumes from the last step it logged, losing nothing (unless
  the SIGTERM came during the last step and the trainer finished the run: then it has completed).
"""
from __future__ import annotations

from collections.abc import Callable

from ..faults.injection import FaultOutcome
from ..model.crash import CrashPoint
from ..model.process import RunSpec
from ..run.runners import Stop
from .common import resumed_from, signal_fault
from .failures import format_mismatches, loss_mismatches, stderr_tail
from .session import Session


def preemption(session: Session, check: str, spec: RunSpec, _param, point: CrashPoint) -> None:
    outcome, where = signal_fault(session, check, spec, point, Stop(grace_s=session.grace_s))
    found = judge(outcome, session.baseline(spec).losses, session.tolerance(spec),
                  saves_on_term=session.adapter.has("preemption_save"),
                  grace_s=session.grace_s, same_as_plain=lambda r, losses: session.same_as_plain_resume(spec, r, losses))
    if found is not None:
        problem, details = found
        raise session.fail(check, spec, problem, details=where + details, case={"point": str(point)})


def judge(outcome: FaultOutcome, baseline: dict[int, float], tol: float, *, saves_on_term: bool, grace_s: float,
          same_as_plain: Callable[[int, dict[int, float]], bool]) -> tuple[str, str] | None:
    """(problem, details) if the SIGTERMed process or the next start did wrong, else None; a pure
    function of the runs (`same_as_plain(r, losses)`: whether a plain resume from step r gives
    those losses)."""
    kill, first, final, spec = outcome.planned, outcome.first, outcome.final, outcome.spec
    last = max(first.losses, default=0)
    if first.returncode == 0 and last < spec.total_steps:
        return (f"on SIGTERM the trainer exited 0 at step {last} of {spec.total_steps}: a scheduler (Kubernetes "
                "marks the Job Completed) would never restart it; exit non-zero (128+15) instead"), ""
    if saves_on_term and first.stopped:
        return (f"the trainer declares 'preemption_save' but was still running {grace_s:g} s after SIGTERM "
                "(SIGKILLed at the end of the grace period)"), "  stderr:\n" + stderr_tail(first.stderr)
    r = outcome.resumed_from
    if final.returncode != 0:
        return (f"after the SIGTERM the next start could not resume (exit {final.returncode})",
                "  stderr:\n" + stderr_tail(final.stderr))
    if r < kill.newest_committed:
        return (f"after the SIGTERM the next start resumed {resumed_from(r)}, "
                f"older than the checkpoint of step {kill.newest_committed} committed before it"), ""
    # A trainer that got SIGTERM during its last step and finished the run (exit 0 at total_steps)
    # has completed: no scheduler restarts it, and a final checkpoint is not required.
    completed = first.returncode == 0 and last >= spec.total_steps
    if saves_on_term and r != last and not completed:
        return (f"the trainer declares 'preemption_save': it had logged step {last} when it exited, but the next "
                f"start resumed from step {r}" + (" (a second save started inside the first, or left it torn?)"
                                                  if kill.in_progress else "")), ""
    rows = loss_mismatches(baseline, final.losses, tol)
    if rows and not (r > 0 and same_as_plain(r, final.losses)):
        return (f"after the SIGTERM the next start resumed from step {r} and diverges: it loaded incomplete state",
                "  first differing steps:\n" + format_mismatches(rows))
    return None
