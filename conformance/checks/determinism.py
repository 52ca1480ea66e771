"""determinism_precondition: two uninterrupted runs agree, in their losses and in their
filesystem operations (run-random names aside). Without it no resume can be judged."""
from __future__ import annotations

from ..model import evidence
from ..model.process import RunSpec
from .session import Session


def determinism_precondition(session: Session, check: str, spec: RunSpec, _param=None, _case=None) -> None:
    found = session.determinism(spec)
    evidence.record(found.evidence)
    problem = found.losses_problem or found.operations_problem
    if problem:
        first, _, rest = problem.partition("\n")
        raise session.fail(check, spec, first, details=rest)
