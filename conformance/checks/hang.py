"""hang: one rank of a multi-rank job frozen inside a save (SIGSTOP, as a deadlocked framework, a
stuck NFS call or a swapped-out node looks from outside). Its peers wait in a collective for it.

- The job must notice and end: some rank gives up (its collective's timeout) and exits, and
  torchrun stops the rest, within --hang-timeout (default 30 s) of the stop. The trainer is told a
  third of that in CONFORMANCE_HANG_TIMEOUT, for its process group's timeout; one that sets none
  waits for ever (gloo's default is 30 minutes), which the suite reports as a hang, with the time
  it waited, and ends itself.
- Then the stopped rank is killed with the rest, and the next start (with no hint) must resume
  from at least the newest checkpoint committed before the stop and match the baseline.
"""
from __future__ import annotations

from ..model.crash import CrashPoint
from ..model.process import RunSpec
from ..run.runners import Stop
from ..run.watchdog import grace_expired
from .common import resumed_from, signal_fault
from .failures import format_mismatches, loss_mismatches, stderr_tail
from .session import Session

HINT_SHARE = 1 / 3   # the share of --hang-timeout the trainer is told to wait for a peer


def hang(session: Session, check: str, spec: RunSpec, _param, point: CrashPoint) -> None:
    baseline = session.baseline(spec)
    told = round(session.hang_timeout * HINT_SHARE, 1)
    outcome, fault = signal_fault(session, check, spec, point, Stop(grace_s=session.hang_timeout, signal="STOP"),
                                  faulted_spec=spec.but(hang_timeout=told))
    kill, first, final = outcome.planned, outcome.first, outcome.final
    where = fault + f"  CONFORMANCE_HANG_TIMEOUT={told:g} was set for the job; --hang-timeout={session.hang_timeout:g}\n"
    case = {"point": str(point), "hang_timeout": f"{session.hang_timeout:g}"}
    if grace_expired(first.stopped):
        raise session.fail(check, spec, f"the job hung: still running {session.hang_timeout:g} s after one rank was "
                           "stopped, and no rank gave up (a process group without a timeout? gloo's default is 30 "
                           "minutes); the suite killed it",
                           details=where + "  " + first.stopped.partition("; ")[2] + "\n  stderr:\n"
                           + stderr_tail(first.stderr), case=case)
    r = outcome.resumed_from
    problem = None
    if final.returncode != 0:
        problem = f"after the stopped rank was killed, the next start could not resume (exit {final.returncode})"
    elif r < kill.newest_committed:
        problem = (f"after the stopped rank was killed, the next start resumed {resumed_from(r)}, older than the "
                   f"checkpoint of step {kill.newest_committed} committed before the stop")
    else:
        rows = loss_mismatches(baseline.losses, final.losses, session.tolerance(spec))
        if rows and not (r > 0 and session.same_as_plain_resume(spec, r, final.losses)):
            problem = (f"after the stopped rank was killed, the next start resumed from step {r} and diverges: the "
                       "job committed a checkpoint the stopped rank never finished\n  first differing steps:\n"
                       + format_mismatches(rows))
    if problem:
        raise session.fail(check, spec, problem, details=where + f"  the job: {first.stopped or 'exited'}\n  stderr:\n"
                           + stderr_tail(final.stderr), case=case)
