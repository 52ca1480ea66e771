"""io_error[enospc|eio]: a write, sync, rename or mkdir of a save fails (a full disk, a quota,
network storage returning EIO), then the trainer starts again on what it left.

- The trainer notices: it exits non-zero naming the error, or it goes on training and commits the
  failed step's save after all (a retry) before its next save begins. Going on without the save
  is a failure that passed silently: the step it failed to save never exists, and on a disk that
  stays full such a job trains for days without a checkpoint while it reports success (orbax#605,
  maxtext#5260). A team that chooses availability over durability waives it in its
  expected-failures file, with the reason.
- After a failed fsync the data may be gone even if a retried fsync succeeds (fsyncgate): renaming
  that file into place is a failure.
- The previous checkpoint stays loadable: the next start resumes from at least the newest save
  committed before the failure, exits 0 and matches the baseline.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from ..faults.injection import ERRNOS, FaultOutcome, committed_after_failed_sync, run_fault
from ..faults.scenario import plan
from ..model import evidence
from ..model.crash import CrashPoint
from ..model.process import RunSpec
from .common import resumed_from
from .failures import format_mismatches, loss_mismatches, stderr_tail
from .fixes import ERRNO_LOST, FSYNC_FAILED_COMMITTED, CauseFix
from .session import Session

_NAMES = {"ENOSPC": r"No space left on device|ENOSPC|Errno 28\b|errno 28\b",
          "EDQUOT": r"Disk quota exceeded|EDQUOT|Errno 122\b|errno 122\b",
          "EIO": r"Input/output error|\bEIO\b|Errno 5\b|errno 5\b"}


def io_error(session: Session, check: str, spec: RunSpec, param: str, point: CrashPoint) -> None:
    errno = ERRNOS[param]
    baseline = session.baseline(spec)
    save = point_save(baseline, point) or spec.total_steps
    outcome = run_fault(session.runner, session.adapter, spec, point, f"error={errno}", session.case_dir(f"io-{param}"),
                        baseline, went_on_past=save, stable=session.stable_paths(spec))
    kill, first, final = outcome.planned, outcome.first, outcome.final
    where = f"{errno} injected into {kill.text}, inside the save of step {kill.in_progress}"
    evidence.record(evidence.Fault(check=check, point=str(point), planned=kill.text, fault=errno,
                                   first_exit=first.returncode, went_on=went_on(outcome), resumed_from=outcome.resumed_from,
                                   final_exit=final.returncode))
    found = judge(outcome, errno, baseline.losses, session.tolerance(spec), committed_after_failed_sync(outcome.first_run),
                  same_as_plain=lambda r, losses: session.same_as_plain_resume(spec, r, losses))
    if found is not None:
        problem, details, fix = found
        raise session.fail(check, spec, problem, details=f"  fault: {where}\n" + details, case={"point": str(point)},
                           fix=fix)


def went_on(outcome: FaultOutcome) -> bool:
    """Whether the faulted process trained on to the end (the failed save left behind)."""
    return outcome.first.returncode == 0 and max(outcome.first.losses, default=0) >= outcome.spec.total_steps


def judge(outcome: FaultOutcome, errno: str, baseline: dict[int, float], tol: float, synced_badly: str | None, *,
          same_as_plain: Callable[[int, dict[int, float]], bool]) -> tuple[str, str, CauseFix | None] | None:
    """(problem, details, the cause's fix or None for the check's default) if the faulted process or
    the next start did wrong, else None; a pure function of the runs. `synced_badly`: a file
    committed after its fsync failed, if the faulted run did that (committed_after_failed_sync);
    `same_as_plain(r, losses)`: whether a plain resume from step r gives those losses. A trainer
    that raised but whose stderr lost the errno (torch.save's zip writer, DCP's exception gather)
    gets ERRNO_LOST, not the default's "let a failed write raise"."""
    kill, first, final = outcome.planned, outcome.first, outcome.final
    s, prev = kill.in_progress, kill.newest_committed
    on = went_on(outcome)
    if not on:
        if first.returncode == 0:
            return (f"after {errno} the trainer exited 0 at step {max(first.losses, default=0)} of "
                    f"{outcome.spec.total_steps}: a failed save reported as success"), "", None
        if not re.search(_NAMES[errno], first.stderr):
            return (f"after {errno} the trainer exited {first.returncode} without naming the error on stderr",
                    "  stderr:\n" + stderr_tail(first.stderr), ERRNO_LOST)
    if synced_badly:
        return (f"the trainer committed a file whose fsync failed: {synced_badly}; after a failed fsync the kernel may "
                "have dropped the data (fsyncgate), so the save must be abandoned or written anew"), "", FSYNC_FAILED_COMMITTED
    what = "went on training" if on else f"exited {first.returncode}"
    r = outcome.resumed_from
    if final.returncode != 0:
        return (f"after the failed save the trainer {what}; the next start could not resume (exit "
                f"{final.returncode})" + (f" although the checkpoint of step {prev} had been committed before the "
                                         "failure" if prev else ""), "  stderr:\n" + stderr_tail(final.stderr), None)
    if r < prev:
        return (f"after the failed save the trainer {what}; the next start resumed "
                f"{resumed_from(r)}: the checkpoint of step {prev}, committed "
                "before the failure, was lost (deleted or overwritten after the failed save?)"), "", None
    if on and final.returncode == 0 and 0 <= r < s:
        return (f"a failed save passed silently: after {errno} in the save of step {s} the trainer went on training "
                f"and exited 0, and the save of step {s} was never committed (no retry before its next save began): "
                f"a start on the directory it left then resumed {resumed_from(r)}",
                "  a trainer that goes on after a failed save must retry it until it commits, or exit non-zero "
                "before claiming success; to choose availability over durability, waive this check in the "
                "expected-failures file with the reason\n  stderr of the faulted run:\n" + stderr_tail(first.stderr),
                None)
    rows = loss_mismatches(baseline, final.losses, tol)
    if rows and not (r > 0 and same_as_plain(r, final.losses)):
        return (f"after the failed save the trainer {what}; the next start resumed from step {r} and diverges: "
                + ("it loaded the failed save" if r == s else "it loaded damaged state"),
                "  first differing steps:\n" + format_mismatches(rows), None)
    return None


def point_save(baseline, point: CrashPoint) -> int | None:
    """The save an operation's point (`save:s/i`, `fs:i`) falls in."""
    kill = plan(point, baseline)
    return kill.in_progress if kill else None
