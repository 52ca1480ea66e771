"""interrupt: Ctrl-C. SIGINT at a step or at an operation inside a save (a background save's
too), to the process, or, for a job, to torchrun's whole process group as a terminal sends it.

Python raises KeyboardInterrupt wherever the main thread is, so every `except`/`finally` and every
"save on interrupt" handler runs in the middle of a save. That is what a kill never exercises: a
`finally` that commits, or an `__exit__` that writes the marker whatever happened.
- The trainer exits within the grace period (SIGKILL after it), and not with 0 before
  TOTAL_STEPS: whatever runs next (`train && upload`, a scheduler) would take the run as done.
- The next start resumes from at least the newest checkpoint committed before the SIGINT
  (nothing committed is lost) and matches the baseline: no torn or mixed state was committed.
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


def interrupt(session: Session, check: str, spec: RunSpec, _param, point: CrashPoint) -> None:
    outcome, where = signal_fault(session, check, spec, point, Stop(grace_s=session.grace_s, signal="INT"))
    found = judge(outcome, session.baseline(spec).losses, session.tolerance(spec), grace_s=session.grace_s,
                  same_as_plain=lambda r, losses: session.same_as_plain_resume(spec, r, losses))
    if found is not None:
        problem, details = found
        raise session.fail(check, spec, problem, details=where + details, case={"point": str(point)})


def judge(outcome: FaultOutcome, baseline: dict[int, float], tol: float, *, grace_s: float,
          same_as_plain: Callable[[int, dict[int, float]], bool]) -> tuple[str, str] | None:
    """(problem, details) if the interrupted process or the next start did wrong, else None."""
    kill, first, final, spec = outcome.planned, outcome.first, outcome.final, outcome.spec
    last = max(first.losses, default=0)
    if first.stopped:
        return (f"the trainer was still running {grace_s:g} s after Ctrl-C's SIGINT (SIGKILLed at the end of the "
                "grace period): an interrupt handler that blocks, or a non-daemon thread that never ends"), \
            "  stderr:\n" + stderr_tail(first.stderr)
    if first.returncode == 0 and last < spec.total_steps:
        return (f"on SIGINT the trainer exited 0 at step {last} of {spec.total_steps}: whatever runs next "
                "(`train && upload`, a scheduler) takes the run as finished; exit non-zero (130) instead"), ""
    if final.returncode != 0:
        return (f"after the SIGINT the next start could not resume (exit {final.returncode}): it took the interrupted "
                "save for a complete one (a `finally` or `__exit__` that committed it, or a newest-by-name pick)",
                "  stderr of the interrupted process:\n" + stderr_tail(first.stderr, 3)
                + "\n  stderr of the next start:\n" + stderr_tail(final.stderr))
    r = outcome.resumed_from
    if r < kill.newest_committed:
        return (f"after the SIGINT the next start resumed {resumed_from(r)}, older than the checkpoint of step "
                f"{kill.newest_committed} committed before it (the interrupt handler deleted or spoiled it?)"), ""
    rows = loss_mismatches(baseline, final.losses, tol)
    if rows and not (r > 0 and same_as_plain(r, final.losses)):
        return (f"after the SIGINT the next start resumed from step {r} and diverges: the interrupted process "
                "committed a torn or mixed state (saved mid-step, or half a save)",
                "  first differing steps:\n" + format_mismatches(rows))
    return None
