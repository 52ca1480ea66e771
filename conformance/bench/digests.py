"""What the state digests cost: the bundled trainer's digest of its state after one step, and the
suite's comparison of one 14-step curve with digests (measure.py turns them into `digest_cost`)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..checks.failures import loss_mismatches
from ..checks.tolerance import learned
from ..model import evidence
from ..model.adapters import load_object
from ..model.digest import state_digest
from ..model.process import Curve
from .ab import median_time

TRAINER = "resume_conformance.fixtures.reference_trainer:ReferenceTrainer"
CONFIG = "resume_conformance.fixtures.contract:RunConfig"


def digest_seconds(workdir: Path, rounds: int = 200) -> tuple[float, float]:
    """(the bundled trainer's state digest after a step, the suite's comparison of one 14-step
    curve with digests), each the median of `rounds` calls, in seconds."""
    d = Path(tempfile.mkdtemp(prefix="digest-", dir=workdir))
    try:
        trainer = load_object(TRAINER)(load_object(CONFIG)(d / "ckpt", 14, 0, 0, d / "loss.jsonl"))
        trainer.train_step(next(iter(trainer.sampler)))   # Adam's moments exist: full-size optimizer state
        digest_s, _ = median_time(lambda: state_digest(**trainer.state_components()), rounds)
        one = state_digest(**trainer.state_components())
        curve = Curve({s: float(s) for s in range(1, 15)}, states={s: dict(one) for s in range(1, 15)})
        tol = learned(0.0, 1e-4, tuple(sorted(one)))
        compare_s, _ = median_time(lambda: loss_mismatches(curve, curve, tol), rounds)
        evidence.take()                # the comparisons recorded nothing a test should see
        return digest_s, compare_s
    finally:
        shutil.rmtree(d, ignore_errors=True)
