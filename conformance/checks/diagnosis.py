"""Name the likely cause of a resume that diverges, from controlled experiments on the trainer.

Run only when resume_matches_baseline fails. Every experiment stops the trainer cleanly at a step
(a run with total_steps=k and a save at every step) and resumes it in a new process, so no kill is
involved; the reference is an uninterrupted run with the same save cadence.

- sweep: stop at every step k and resume. Resumes that match at some steps only (e.g. every
  fifth: epoch boundaries) point at the data position within an epoch.
- seed: resume the same checkpoint once with CONFORMANCE_SEED changed. A resumed run that
  depends on the seed re-seeds an RNG instead of restoring it.
- first step: does the first resumed step already differ (the forward pass sees other
  parameters, buffers, batch or randomness), or only later ones (optimizer, scheduler, an RNG used
  after the loss)?
- same process: save and resume within one process (warm runner only). A match there, but not
  across processes, means state kept outside the checkpoint (module globals, caches).
- state digests, where the trainer logs them (checks/digests.py): the first component whose digest
  leaves the uninterrupted run's, right after the resumed process's set-up or after a step, names
  the state directly; no other experiment is needed.

A cause is claimed only where an experiment separates it from the others; each is listed under it.
Otherwise the verdict is "cannot tell", with the candidates named.
"""
from __future__ import annotations

import dataclasses

from ..model.process import RunSpec
from ..run.forkserver import warm_target
from .digests import StateMismatch, first_state_mismatch
from .failures import loss_mismatches, step_ranges
from .session import Session


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    cause: str
    evidence: tuple[str, ...]

    def render(self) -> str:
        return "  likely cause: " + self.cause + "".join(f"\n    - {e}" for e in self.evidence)


@dataclasses.dataclass(frozen=True)
class Resumed:
    losses: dict[int, float]
    first_step: int | None
    stopped: dict[int, float] = dataclasses.field(default_factory=dict)   # the run stopped at k


def _stop_and_resume(session: Session, spec: RunSpec, k: int, seed: int, *, same_process: bool = False
                     ) -> Resumed | None:
    """A run resumed from the checkpoint of step k (saved by a run stopped there, seed spec.seed)
    with `seed`; None if the stopped run or the resume failed. Cached: Hypothesis replays a
    failing example while shrinking, and each experiment needs to run once."""
    return session._cached(("diagnose-resume", spec, k, seed, same_process),
                           lambda: _run_stop_and_resume(session, spec, k, seed, same_process))


def _run_stop_and_resume(session: Session, spec: RunSpec, k: int, seed: int, same_process: bool) -> Resumed | None:
    d = session.case_dir(f"diagnose-{k}-{seed}")
    ckpt = (d / "ckpt").resolve()
    ckpt.mkdir()
    first = spec.but(total_steps=k, save_every=1)
    second = spec.but(save_every=1, seed=seed)
    if same_process:
        run_twice = getattr(session.runner, "run_twice", None)
        if run_twice is None:
            return None
        result = run_twice(session.adapter, first, second, ckpt, (d / "loss1.jsonl").resolve(),
                           (d / "loss2.jsonl").resolve())
    else:
        stopped = session.runner.run_process(session.adapter, first, ckpt, (d / "loss1.jsonl").resolve())
        if stopped.returncode != 0 or max(stopped.losses, default=0) != k:
            return None
        result = session.runner.run_process(session.adapter, second, ckpt, (d / "loss2.jsonl").resolve())
    if result is None or result.returncode != 0:
        return None
    return Resumed(result.losses, result.first_step, {} if same_process else stopped.losses)


def _reference(session: Session, spec: RunSpec) -> dict[int, float] | None:
    def compute():
        d = session.case_dir("diagnose-ref")
        (d / "ckpt").mkdir()
        run = session.runner.run_process(session.adapter, spec.but(save_every=1),
                                         (d / "ckpt").resolve(), (d / "loss.jsonl").resolve())
        return run.losses if run.returncode == 0 else None
    return session._cached(("diagnose-ref", spec), compute)


def _sweep(session: Session, spec: RunSpec, ref: dict[int, float]) -> dict[int, Resumed | None]:
    """Stop at every step that leaves at least two steps to compare, and resume."""
    def compute():
        return {k: _stop_and_resume(session, spec, k, spec.seed) for k in range(1, spec.total_steps - 1)}
    return session._cached(("diagnose-sweep", spec), compute)


def _period(matching: list[int], total: int) -> int | None:
    """p if the matching resume points are exactly the multiples of p that were tried (p >= 2): the
    epoch boundaries of an epoch of p steps. One match counts when no second multiple was tried (an
    epoch longer than half the run has one boundary inside it)."""
    if not matching:
        return None
    p = matching[0]
    return p if p >= 2 and matching == list(range(p, total - 1, p)) else None


def diagnose(session: Session, spec: RunSpec, resumed_from: int, resumed: dict[int, float]) -> Diagnosis:
    """The likely cause of `resumed` (a process that resumed from step `resumed_from`) differing
    from the baseline."""
    base = session.baseline(spec).losses
    tolerance = session.tolerance(spec)
    tol = tolerance.value
    found = first_state_mismatch(base, resumed, tolerance.digests)
    if found is not None:
        return _from_digests(session, spec, found, resumed_from)
    ref = _reference(session, spec)
    if ref is None or loss_mismatches(base, ref, tol):
        return Diagnosis("cannot tell", ("an uninterrupted run that saves at every step does not reproduce the "
                                         "baseline, so stop-and-resume experiments have no reference",))
    evidence = []
    sweep = _sweep(session, spec, ref)
    diverging_stop = next((k for k, r in sweep.items() if r is not None and loss_mismatches(ref, r.stopped, tol)),
                          None)
    if diverging_stop is not None:
        return Diagnosis("cannot tell: stop-and-resume experiments do not apply to this trainer",
                         (f"a run stopped at step {diverging_stop} (CONFORMANCE_TOTAL_STEPS={diverging_stop}) does not "
                          "reproduce the first steps of the full run: its training depends on the step budget (an LR "
                          "schedule over max_steps?)",))
    wrong_start = {k: r.first_step for k, r in sweep.items() if r is not None and r.first_step != k + 1}
    if wrong_start:
        k, got = next(iter(wrong_start.items()))
        return Diagnosis("the step counter: after a clean stop at step k the trainer does not continue at step k+1",
                         (f"stopped after saving step {k}, the next process logged step {got} first"
                          + (f" (and {len(wrong_start) - 1} more resume points like it)" if len(wrong_start) > 1
                             else ""),))
    ran = {k: not loss_mismatches(ref, r.losses, tol) for k, r in sweep.items() if r is not None}
    matching = sorted(k for k, ok in ran.items() if ok)
    failing = sorted(k for k, ok in ran.items() if not ok)
    if ran:
        evidence.append(f"stopped at each step and resumed: matches from {step_ranges(matching) or 'no step'}, "
                        f"differs from {step_ranges(failing) or 'no step'}")
    r = resumed_from if 0 < resumed_from < spec.total_steps else (failing[len(failing) // 2] if failing else 0)
    seed_dependent = None
    if r:
        same = _stop_and_resume(session, spec, r, spec.seed)
        other = _stop_and_resume(session, spec, r, spec.seed + 1)
        if same is not None and other is not None:
            seed_dependent = bool(loss_mismatches(same.losses, other.losses, tol))
            evidence.append(f"resumed from step {r} with CONFORMANCE_SEED={spec.seed + 1} instead of {spec.seed}: "
                            + ("the losses change, so an RNG is re-seeded from the seed instead of restored"
                               if seed_dependent else "the losses do not change"))
    first = min(resumed, default=None)
    first_differs = None
    if first is not None and first in base:
        first_differs = not abs(resumed[first] - base[first]) <= tol
        evidence.append(f"the first resumed step ({first}) " + ("already differs" if first_differs else
                                                                "matches; later steps differ"))
    outside = None
    if r and warm_target(session.adapter)[0] is not None and failing:
        together = _stop_and_resume(session, spec, r, spec.seed, same_process=True)
        if together is not None:
            outside = not loss_mismatches(ref, together.losses, tol) and r in failing
            evidence.append(f"saved and resumed from step {r} within one process: "
                            + ("matches, while a new process does not" if outside else "differs as well"))
    period = _period(matching, spec.total_steps)
    if not failing and ran:
        return Diagnosis("cannot tell: a clean stop and resume matches at every step, so the divergence needs the "
                         "kill (state written but not yet complete when it came?)", tuple(evidence))
    if outside:
        return Diagnosis("state kept outside the checkpoint (module-level globals, caches, or a global RNG the "
                         "checkpoint does not capture)", tuple(evidence))
    if seed_dependent:
        return Diagnosis("RNG state: a random generator is re-seeded from CONFORMANCE_SEED on resume instead of "
                         "restored from the checkpoint", tuple(evidence))
    if first_differs is True:
        if period is not None:
            return Diagnosis(f"the data position within an epoch: resumes match only when stopped at "
                             f"{step_ranges(matching)}, every {period} steps (epoch boundaries, presumably), and the first "
                             "resumed step differs, so a mid-epoch resume does not continue with the right batch",
                             tuple(evidence))
        if matching:
            return Diagnosis("cannot tell: resumes match at some steps and not others, without a pattern",
                             tuple(evidence))
        return Diagnosis("cannot tell: the first resumed step already differs, so its forward pass sees other state, "
                         "but no experiment here separates the candidates: parameters or buffers not restored, the "
                         "batch (data position), or an RNG draw made between the restore and the first step (an "
                         "iterator created after the restore draws a seed); log state digests "
                         "(docs/running.md, \"State digests\") to have the suite name it", tuple(evidence))
    if first_differs is False:
        if period is not None:
            return Diagnosis(f"LR scheduler state: the first resumed step matches and resumes match only every "
                             f"{period} steps (the schedule's period?)", tuple(evidence))
        return Diagnosis("cannot tell between optimizer state, LR scheduler state and an RNG used after the loss: the "
                         "first resumed step matches and later ones differ; log state digests to have the suite "
                         "name it", tuple(evidence))
    return Diagnosis("cannot tell", tuple(evidence))


COMPONENTS = {"model": "model state (parameters or buffers)", "optimizer": "optimizer state",
              "scheduler": "LR scheduler state", "rng": "RNG state", "data": "the data position"}


def _from_digests(session: Session, spec: RunSpec, found: StateMismatch, resumed_from: int) -> Diagnosis:
    """The cause the trainer's own state digests show, with that comparison (and, for the RNG
    right after set-up, the seed experiment that tells re-seeding from a draw) as its evidence."""
    what = " and ".join(COMPONENTS.get(c, f"{c} state") for c in found.differs)
    seen = [f"state digests the trainer logged: {found.describe()}" + (f" (the resume was from step {resumed_from})"
                                                                       if resumed_from > 0 else "")]
    if not found.at_setup:
        return Diagnosis(f"{what}: restored differently or not at all (the components named equal were restored "
                         "exactly)", tuple(seen))
    if found.differs == ("rng",) and 0 < resumed_from < spec.total_steps:
        same = _stop_and_resume(session, spec, resumed_from, spec.seed)
        other = _stop_and_resume(session, spec, resumed_from, spec.seed + 1)
        if same is not None and other is not None:
            seeded = bool(loss_mismatches(same.losses, other.losses, session.tolerance(spec).value))
            seen.append(f"resumed from step {resumed_from} with CONFORMANCE_SEED={spec.seed + 1} instead of "
                        f"{spec.seed}: the losses " + ("change" if seeded else "do not change"))
            if seeded:
                return Diagnosis("RNG state: a random generator is re-seeded from CONFORMANCE_SEED on resume instead "
                                 "of restored from the checkpoint (not saved, not restored, or seeded again after the "
                                 "load)", tuple(seen))
            return Diagnosis("RNG state, right after the resumed process's set-up and not through the seed: a "
                             "generator not restored, or drawn from between the restore and the first step (creating "
                             "a DataLoader iterator after the load draws its base seed from the global torch "
                             "generator)", tuple(seen))
    return Diagnosis(f"{what}: not what the uninterrupted run had at step {found.step} by the time the resumed "
                     "process trains: not saved or not restored, kept at a lower precision than it is trained in, "
                     "or changed by the set-up after the load", tuple(seen))
