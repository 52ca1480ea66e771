"""untrusted_checkpoint: loading a checkpoint must never run code embedded in it."""
from __future__ import annotations

from ..faults.corrupt import plant_malicious_pickle
from ..model import evidence
from ..model.process import RunSpec
from .common import copy_prefix
from .session import Session


def untrusted_checkpoint(session: Session, check: str, spec: RunSpec, _param=None, _case=None) -> None:
    """Each file of the newest checkpoint in turn is replaced by a pickle that runs code when
    loaded. One at a time: a loader that parses a safe file first would otherwise fail before it
    reaches the one it unpickles unsafely."""
    d, copies, stop = copy_prefix(session, spec, "untrusted-0", check)
    outcomes = []
    for i in range(len(copies)):
        if i:   # a fresh copy for each file, so only that one file is replaced
            d, copies, _ = copy_prefix(session, spec, f"untrusted-{i}", check)
        target = copies[i]
        marker = d / "UNTRUSTED-CODE-RAN"
        plant_malicious_pickle(target, marker)
        result = session.runner.run_process(session.adapter, spec, (d / "ckpt").resolve(), (d / "loss.jsonl").resolve())
        outcomes.append((target, marker.exists(), result))
    ran = [(t, r) for t, hit, r in outcomes if hit]
    evidence.record(evidence.Untrusted(files=tuple(t.name for t, _, _ in outcomes),
                                       code_ran=tuple(t.name for t, _ in ran),
                                       exit_codes=tuple(r.returncode for _, _, r in outcomes)))
    if ran:
        target, result = ran[0]
        raise session.fail(check, spec, f"loading the checkpoint of step {stop} ran code embedded in {target.name} "
                           "(weights_only=False or plain pickle on an untrusted file)",
                           details=f"  replaced (one at a time): {', '.join(t.name for t, _, _ in outcomes)}\n"
                                   f"  code ran when replacing: {', '.join(t.name for t, _ in ran)}\n"
                                   f"  exit code: {result.returncode}")
