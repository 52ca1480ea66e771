"""Checks of a trainer with a cold tier (node_loss) and of one that resumes from an older
checkpoint on request (branch_resume).

node_loss: the trainer is killed just before its Nth change to the cold tier (an upload, a
marker, a deletion: the changes recorded in the baseline by coldstore.py; N past the last one is
a run that finished), then the hot checkpoint directory is wiped, as when a node is lost, and the
next start must resume from the cold tier and match the baseline. Uploads may lag: the resume must
come from at least the save before the newest save logged before the kill (0 if none).

branch_resume: after a whole run, the trainer is started with CONFORMANCE_RESUME_FROM=S (the
best checkpoint by the metric it logs, with capability keep_best; else its second newest save).
It must resume at S, and its new curve must match the baseline from S. Then every file of the
original line (each file one save of the first run wrote and that was still there at its end) must
still exist, byte for byte, in the checkpoint directory or the cold tier: a branch never writes
over or deletes the line it branched from.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from hypothesis import strategies as st

from .. import evidence
from ..coldstore import read_log
from ..failures import format_mismatches, loss_mismatches, stderr_tail
from ..process import RunSpec, cold_log, cold_root, copy_checkpoint_dir
from ..recording import RecordedRun
from .session import Session


def cold_changes(baseline: RecordedRun):
    return read_log(cold_log(baseline.ckpt_dir))


def kill_points(baseline: RecordedRun) -> st.SearchStrategy[int]:
    """Kills inside a batch of changes (an upload or a demotion under way: a change after another
    one made between the same two steps) first, then any change, or none (N+1)."""
    changes = cold_changes(baseline)
    inside = [c.n for prev, c in zip(changes, changes[1:]) if c.after_step == prev.after_step]
    every = st.integers(1, len(changes) + 1)
    return st.one_of(st.sampled_from(inside), every) if inside else every


def node_loss(session: Session, check: str, spec: RunSpec, _param, kill_at: int) -> None:
    baseline = session.baseline(spec)
    changes = cold_changes(baseline)
    if not changes:
        raise session.fail(check, spec, "the trainer declares capability 'cold_tier' but its uninterrupted run changed "
                           "nothing in CONFORMANCE_COLD_URL: nothing was ever uploaded", case={"cold_op": str(kill_at)})
    d = session.case_dir("node-loss")
    ckpt = (d / "ckpt").resolve()
    ckpt.mkdir()
    killed = kill_at <= len(changes)
    first = session.runner.run_process(session.adapter, spec.but(cold_kill_at=kill_at if killed else None), ckpt,
                                       d / "first-loss.jsonl")
    logged = max(first.losses, default=0)
    where = (f"killed before cold change #{kill_at} ({changes[kill_at - 1].op} {changes[kill_at - 1].path} in the "
             f"baseline), after step {logged} was logged" if killed else f"a whole run ({logged} steps), no kill")
    shutil.rmtree(ckpt)      # the node is lost: the local disk with it
    ckpt.mkdir()
    final = session.runner.run_process(session.adapter, spec, ckpt, d / "final-loss.jsonl")
    r = final.resumed_from(spec)
    saves = [s for s in baseline.saves() if s <= logged]
    bound = saves[-2] if len(saves) >= 2 else 0
    evidence.record(evidence.Fault(check=check, point=f"cold:{kill_at}", planned=where, fault="node loss",
                                   first_exit=first.returncode, went_on=False, resumed_from=r,
                                   final_exit=final.returncode))

    def fail(problem: str, details: str = ""):
        return session.fail(check, spec, problem, details=f"  fault: {where}; then the checkpoint directory was "
                            f"wiped\n" + details, case={"cold_op": str(kill_at)})

    if killed and first.returncode not in (-9, 0):
        raise fail(f"the first run exited {first.returncode} before cold change #{kill_at}, where it was to be "
                   "killed", "  stderr:\n" + stderr_tail(first.stderr))
    # Exit 0: it finished with fewer changes than the baseline (uploads merged differently): a
    # whole run, then the node loss, which is still a case worth judging.
    if final.returncode != 0:
        raise fail(f"after the node loss the next start exited {final.returncode}", "  stderr:\n" + stderr_tail(final.stderr))
    if r < bound:
        raise fail(f"after the node loss the next start resumed {'from scratch' if r == 0 else f'from step {r}'}; the "
                   f"save of step {bound} had been uploaded (a save before the newest, {saves[-1]}) and should be "
                   "in the cold tier")
    rows = loss_mismatches(baseline.losses, final.losses, session.tol)
    if rows:
        raise fail(f"after the node loss the next start resumed from step {r} and diverges: it loaded incomplete "
                   "state from the cold tier", "  first differing steps:\n" + format_mismatches(rows))


def _metrics(loss_log: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    if loss_log.exists():
        for line in loss_log.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
                if isinstance(rec.get("metric"), (int, float)):
                    out[int(rec["step"])] = float(rec["metric"])
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
    return out


def branch_point(session: Session, baseline: RecordedRun) -> tuple[int, str]:
    """The step branch_resume resumes from, and why that one."""
    saves = baseline.saves()
    if session.adapter.has("keep_best"):
        metrics = _metrics(baseline.ckpt_dir.parent / "baseline-loss.jsonl")
        scored = [(metrics[s], s) for s in saves if s in metrics]
        if scored:
            value, step = min(scored)
            return step, f"the best checkpoint by the metric it logged ({value:.6g})"
    return (saves[-2], "its second newest save") if len(saves) >= 2 else (0, "")


def old_line_files(baseline: RecordedRun) -> dict[str, int]:
    """Relative path -> the save that wrote it, for files exactly one save wrote that are still
    there at the end (a file rewritten by every save, a `latest` pointer, is run state)."""
    writers: dict[str, set[int]] = {}
    for step, idxs in baseline.windows().items():
        for i in idxs:
            op = baseline.ops[i]
            if op.kind in ("write", "create", "rename", "link"):
                path = op.target if op.kind in ("rename", "link") else op.path
                if path and not path.startswith("/"):
                    writers.setdefault(path, set()).add(step)
    return {p: next(iter(s)) for p, s in writers.items()
            if len(s) == 1 and 0 not in s and (baseline.ckpt_dir / p).is_file()}


def _digests(*roots: Path) -> set[str]:
    out = set()
    for root in roots:
        for path in (root.rglob("*") if root.is_dir() else ()):
            if path.is_file() and not path.is_symlink():
                out.add(hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def branch_resume(session: Session, check: str, spec: RunSpec, _param, _case) -> None:
    baseline = session.baseline(spec)
    step, why = branch_point(session, baseline)
    if step == 0:
        raise session.fail(check, spec, f"the run saved fewer than two checkpoints (saves: {baseline.saves()}): "
                           "nothing older to resume from")
    d = session.case_dir("branch")
    ckpt = (d / "ckpt").resolve()
    copy_checkpoint_dir(baseline.ckpt_dir, ckpt, spec.cold)
    old = {p: hashlib.sha256((ckpt / p).read_bytes()).hexdigest() for p in old_line_files(baseline)}
    branch = session.runner.run_process(session.adapter, spec.but(resume_from=step), ckpt, d / "branch-loss.jsonl")
    r = branch.resumed_from(spec)
    where = f"CONFORMANCE_RESUME_FROM={step} ({why}), after a whole run of {spec.total_steps} steps"

    def fail(problem: str, details: str = ""):
        return session.fail(check, spec, problem, details=f"  asked: {where}\n" + details)

    if branch.returncode != 0:
        raise fail(f"the trainer could not resume from step {step} (exit {branch.returncode}): was that checkpoint "
                   "deleted?", "  stderr:\n" + stderr_tail(branch.stderr))
    if r != step:
        raise fail(f"asked to resume from step {step}, the trainer resumed from step {r}")
    rows = loss_mismatches(baseline.losses, branch.losses, session.tol)
    if rows:
        raise fail(f"the new branch from step {step} diverges from the baseline", "  first differing steps:\n"
                   + format_mismatches(rows))
    left = _digests(ckpt, Path(cold_root("file", ckpt))) if spec.cold == "file" else _digests(ckpt)
    gone = sorted(p for p, h in old.items() if h not in left)
    if gone:
        lost = ", ".join(f"{p} (saved at step {old_line_files(baseline)[p]})" for p in gone[:4])
        raise fail(f"the branch wrote over or deleted {len(gone)} file(s) of the line it branched from: {lost}"
                   + (" ..." if len(gone) > 4 else ""))
