"""The start after a finished run: the same job started again (a scheduler's retry, a re-submitted
script, a pipeline re-run), and the same run extended to more steps.

- restart_after_finish: on the directory an uninterrupted run left, a start with the same
  environment exits 0 and trains no step the newest checkpoint already holds; any step it does
  train carries the baseline's loss. Judged for the run as given and for the run lengthened to end
  on its save cadence, whose last step is checkpointed. A trainer that re-trains on the final weights, or starts from
  scratch over existing checkpoints, fails with the steps it logged.
- extend_run (capability `extendable`): on that directory, a start with a larger
  CONFORMANCE_TOTAL_STEPS trains the new steps, and their losses equal a fresh run to the larger
  total. A schedule that depends on the total legitimately cannot do this, hence the capability.

Which checkpoint is newest is learned from the baseline's recording (its last save), not assumed.
"""
from __future__ import annotations

from ..model import evidence
from ..model.process import RunSpec
from .common import plot_mismatch
from .failures import format_mismatches, loss_mismatches, stderr_tail, step_ranges
from .session import Session


def _steps(losses) -> str:
    return step_ranges(losses) or "no step"


def ends_on_save(spec: RunSpec) -> RunSpec | None:
    """The same run lengthened to end on its save cadence (None if it already does): a trainer that
    saves its last step leaves a checkpoint at TOTAL_STEPS, and only a restart on that one shows
    what the trainer makes of a checkpoint of a finished run."""
    if not spec.save_every or spec.total_steps % spec.save_every == 0:
        return None
    return spec.but(total_steps=spec.save_every * -(-spec.total_steps // spec.save_every))


def restart_after_finish(session: Session, check: str, spec: RunSpec, _param=None, _case=None) -> None:
    """The run as given, then (if it does not end on a save step) the run lengthened to end on one."""
    for run in filter(None, (spec, ends_on_save(spec))):
        _restart_after(session, check, spec, run)


def _restart_after(session: Session, check: str, spec: RunSpec, run: RunSpec) -> None:
    baseline = session.baseline(run)
    newest = max(baseline.saves(), default=0)
    again = session.run_once(run, "restart", prepare=baseline.ckpt_dir).result
    redone = {s: loss for s, loss in again.losses.items() if s <= newest}
    rows = loss_mismatches(baseline.losses, again.losses, session.tolerance(run))
    evidence.record(evidence.Fault(check=check, point=f"the end of a {run.total_steps}-step run (newest checkpoint: "
                                   f"step {newest})", planned=f"newest checkpoint: step {newest}", fault="a second start",
                                   first_exit=baseline.result.returncode, went_on=False,
                                   resumed_from=again.resumed_from(run), final_exit=again.returncode))
    where = (f"  the uninterrupted run ended at step {run.total_steps}"
             + (" (lengthened to end on the save cadence)" if run != spec else "")
             + f"; its newest checkpoint was step {newest}\n")
    if again.returncode != 0:
        raise session.fail(check, spec, f"started again after the run had finished, the trainer exited "
                           f"{again.returncode}", details=where + "  stderr:\n" + stderr_tail(again.stderr))
    if redone:
        what = "from scratch" if min(redone) == 1 else f"from step {min(redone) - 1}"
        raise session.fail(check, spec, f"started again after the run had finished, the trainer trained "
                           f"{_steps(redone)} again ({what}), though its newest checkpoint already held step "
                           f"{newest}: it re-trains a finished run (and may overwrite its checkpoints)",
                           details=where + ("  first differing steps:\n" + format_mismatches(rows) if rows else
                                            "  (on the same curve: the work is repeated, not lost)"))
    beyond = {s: loss for s, loss in again.losses.items() if s > run.total_steps}
    if beyond:
        raise session.fail(check, spec, f"started again after the run had finished, the trainer trained "
                           f"{_steps(beyond)} past CONFORMANCE_TOTAL_STEPS={run.total_steps}",
                           details=where + "  stderr:\n" + stderr_tail(again.stderr))
    r = again.resumed_from(run)
    if rows and not (0 < r and session.same_as_plain_resume(run, r, again.losses)):   # else: resume_matches_baseline's
        raise session.fail(check, spec, f"started again after the run had finished, the trainer resumed from "
                           f"step {r} and diverges: it loaded incomplete state",
                           details=where + "  first differing steps:\n" + format_mismatches(rows) + "\n"
                           + plot_mismatch(session, check, run, resumed=[("restarted", again.losses)]))


def extended_total(spec: RunSpec) -> int:
    """The larger total an extended run trains to: two more saves' worth of steps (at least 4)."""
    return spec.total_steps + max(4, 2 * spec.save_every)


def extend_run(session: Session, check: str, spec: RunSpec, _param=None, _case=None) -> None:
    baseline = session.baseline(spec)
    longer = spec.but(total_steps=extended_total(spec))
    fresh = session.run_once(longer, "longer").result
    where = (f"  the first run trained to step {spec.total_steps} (newest checkpoint: step "
             f"{max(baseline.saves(), default=0)}); the second start set CONFORMANCE_TOTAL_STEPS="
             f"{longer.total_steps}\n")
    missing = [s for s in range(1, longer.total_steps + 1) if s not in fresh.losses]
    if fresh.returncode != 0 or missing:
        raise session.fail(check, spec, f"a fresh run to {longer.total_steps} steps "
                           + (f"exited {fresh.returncode}" if fresh.returncode else f"logged no loss for {missing[:5]}"),
                           details="  stderr:\n" + stderr_tail(fresh.stderr))
    extended = session.run_once(longer, "extend", prepare=baseline.ckpt_dir).result
    new_steps = range(spec.total_steps + 1, longer.total_steps + 1)
    evidence.record(evidence.Fault(check=check, point=f"the end of a {spec.total_steps}-step run",
                                   planned="start with a larger total", fault=f"a start with {longer.total_steps} steps",
                                   first_exit=0, went_on=False,
                                   resumed_from=extended.resumed_from(longer), final_exit=extended.returncode))
    if extended.returncode != 0:
        raise session.fail(check, spec, f"started with a larger total ({longer.total_steps}) on a finished run's "
                           f"directory, the trainer exited {extended.returncode}",
                           details=where + "  stderr:\n" + stderr_tail(extended.stderr))
    absent = [s for s in new_steps if s not in extended.losses]
    if absent:
        raise session.fail(check, spec, f"started with a larger total ({longer.total_steps}) on a finished run's "
                           f"directory, the trainer logged {_steps(extended.losses)} and never trained "
                           f"{_steps(dict.fromkeys(absent))}: it does not extend a finished run (a total kept in "
                           "the checkpoint overriding the new one?)",
                           details=where + "  stderr:\n" + stderr_tail(extended.stderr))
    rows = loss_mismatches(fresh.losses, extended.losses, session.tolerance(spec))
    r = extended.resumed_from(longer)
    # A resume that diverges however it is started is resume_matches_baseline's finding, not this one's.
    if rows and not (0 < r and session.same_as_plain_resume(longer, r, extended.losses)):
        raise session.fail(check, spec, f"extended to {longer.total_steps} steps, the new steps' losses differ from "
                           f"a fresh run to {longer.total_steps} (it resumed from step {r})",
                           details=where + "  first differing steps (fresh run vs extended):\n"
                           + format_mismatches(rows)
                           + "\n  if the schedule depends on the total, drop the capability 'extendable'")
