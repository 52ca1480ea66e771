"""corruption_detected: the newest checkpoint is damaged the ways storage damages files; the
trainer must notice (fall back, or exit non-zero with a message), never resume silently wrong."""
from __future__ import annotations

from .. import evidence
from ..corrupt import corrupt
from ..failures import format_mismatches, loss_mismatches, max_abs_diff
from ..process import RunSpec
from .common import copy_prefix, plot_mismatch
from .session import Session


def corruption_detected(session: Session, check: str, spec: RunSpec, kind: str, _case=None) -> None:
    """Damage (truncate, bitflip, delete) the largest file of the newest checkpoint that a resume
    reads; the trainer falls back to an intact checkpoint or exits non-zero with a message."""
    d, files, stop = copy_prefix(session, spec, f"corrupt-{kind}", check)
    read = session.files_read_on_resume(spec)
    ckpt = (d / "ckpt").resolve()
    candidates = [f for f in files if f.relative_to(ckpt).as_posix() in read] or files
    target = max(candidates, key=lambda p: p.stat().st_size)
    what = corrupt(kind, target)
    result = session.runner.run_process(session.adapter, spec, ckpt, (d / "loss.jsonl").resolve())
    base = session.baseline(spec)
    previous = stop - spec.save_every
    details = f"  corruption: {what} (newest checkpoint: step {stop})"
    r = result.resumed_from(spec)
    evidence.record(evidence.Corruption(corruption=kind, file=target.name, what=what, newest_step=stop,
                                        exit_code=result.returncode, resumed_from=r,
                                        max_abs_diff=max_abs_diff(base.losses, result.losses)))
    if result.returncode != 0:
        if not result.stderr.strip():
            raise session.fail(check, spec, f"after corruption the trainer exited {result.returncode} without "
                               "a message on stderr", details=details)
        return
    rows = loss_mismatches(base.losses, result.losses, session.tol)
    if rows and r > 0 and session.same_as_plain_resume(spec, r, result.losses):
        # The trainer resumed from step r exactly as from an undamaged checkpoint: the damage changed
        # nothing it used. (Its divergence is a resume_matches_baseline problem.)
        evidence.record(evidence.Note(f"same curve as a plain resume from step {r}: the damage changed "
                                      "nothing the run used"))
        rows = []
    if rows:
        plot = plot_mismatch(session, check, spec, extra=kind,
                             resumed=[(f"resumed after {kind} of {target.name}", result.losses)], resumes=[r])
        raise session.fail(check, spec, f"the trainer loaded a corrupted checkpoint without noticing (resumed "
                           f"from step {r}, exit 0) and its loss curve diverges",
                           details=details + "\n  first differing steps:\n" + format_mismatches(rows) + "\n" + plot)
    if r < previous:
        what_r = "from scratch" if r == 0 else f"from step {r}"
        raise session.fail(check, spec, f"after corruption the trainer resumed {what_r} instead of falling back "
                           f"to the newest intact checkpoint (step {previous})", details=details)
