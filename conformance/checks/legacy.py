"""schema_migration: checkpoints in an old schema load, and the run resumes from them on the
baseline curve."""
from __future__ import annotations

import shutil
from pathlib import Path

from ..model import evidence
from ..model.process import RunSpec
from .common import plot_mismatch
from .failures import format_mismatches, loss_mismatches, max_abs_diff, stderr_tail
from .session import Session
from .tolerance import capped


def schema_migration(session: Session, check: str, spec: RunSpec, _param=None, only: str | None = None) -> None:
    """Every legacy sample the adapter declares (or the one named `only`)."""
    samples = [s for s in session.adapter.legacy_samples if only in (None, s.name)]
    if not samples:
        raise ValueError(f"the adapter has no legacy sample named {only!r}; it has: "
                         f"{', '.join(s.name for s in session.adapter.legacy_samples) or 'none'}")
    for sample in samples:
        _one_sample(session, check, spec.but(seed=sample.seed), sample)


def _one_sample(session: Session, check: str, spec: RunSpec, sample) -> None:
    base = session.baseline(spec)
    d = session.case_dir("legacy")
    ckpt = (d / "ckpt").resolve()
    ckpt.mkdir()
    src = Path(sample.path)
    if src.is_dir():
        shutil.copytree(src, ckpt / sample.name)
    else:
        shutil.copy2(src, ckpt / sample.name)
    result = session.runner.run_process(session.adapter, spec, ckpt, (d / "loss.jsonl").resolve())
    details = f"  legacy sample: {src} (step {sample.step}, seed {sample.seed})"
    case = {"legacy": sample.name}
    r = result.resumed_from(spec)
    evidence.record(evidence.Legacy(sample=sample.name, step=sample.step, seed=sample.seed,
                                    exit_code=result.returncode, resumed_from=r,
                                    max_abs_diff=max_abs_diff(base.losses, result.losses)))
    if result.returncode != 0:
        raise session.fail(check, spec, f"resuming from a legacy checkpoint exited {result.returncode}",
                           details=details + "\n  stderr:\n" + stderr_tail(result.stderr), case=case)
    if r != sample.step:
        raise session.fail(check, spec, f"the legacy checkpoint of step {sample.step} was not used: the trainer "
                           f"resumed from step {r}", details=details, case=case)
    # The sample was saved on another machine, perhaps by another build: its floating-point state is
    # not the bits this machine's uninterrupted run reaches, so the comparison keeps the cap.
    rows = loss_mismatches(base.losses, result.losses, capped(session.cap, "a legacy sample is state saved on another "
                                                              "machine, whose arithmetic may round differently"))
    if rows:
        plot = plot_mismatch(session, check, spec, extra=f"legacy={sample.name}",
                             resumed=[(f"resumed from {sample.name}", result.losses)], resumes=[r])
        raise session.fail(check, spec, "the run resumed from the migrated checkpoint diverges",
                           details=details + "\n  first differing steps:\n" + format_mismatches(rows) + "\n" + plot,
                           case=case)
