"""Checks of a trainer with a cold tier (node_loss, demotion_safe) and of one that resumes from an older
checkpoint on request (branch_resume).

node_loss: the trainer is killed just before its Nth change to the cold tier (an upload, a
marker, a deletion: the changes recorded in the baseline by coldstore.py; N past the last one is
a run that finished), then the hot checkpoint directory is wiped, as when a node is lost, and the
next start must resume from the cold tier and match the baseline. Uploads may lag: the resume must
come from at least the save before the newest save logged before the kill (0 if none).

demotion_safe: the trainer is killed just before its Nth change to the cold tier, or that change
goes through and a byte of the object it wrote is then flipped while the store reports success
(a store that corrupts silently). It is started again until it finishes (at most twice), then
asked to resume from the checkpoint branch_resume would ask for, which an uninterrupted run keeps:
that must still load and match the baseline. A hot copy deleted before its cold copy was verified
is lost here.

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

from ..model import evidence
from ..model.crash import ColdFault
from ..model.process import RunSpec, cold_log, cold_root, copy_checkpoint_dir
from ..run.coldstore import WHOLE_OBJECT_WRITES, read_log
from ..trace.recording import RecordedRun
from .common import resumed_from
from .failures import format_mismatches, loss_mismatches, stderr_tail
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
                           "nothing in CONFORMANCE_COLD_URL: nothing was ever uploaded", case={"lost_at": str(kill_at)})
    d = session.case_dir("node-loss")
    ckpt = (d / "ckpt").resolve()
    ckpt.mkdir()
    killed = kill_at <= len(changes)
    first = session.runner.run_process(session.adapter, spec.but(cold_fault=ColdFault("kill", kill_at) if killed else None), ckpt,
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
                            f"wiped\n" + details, case={"lost_at": str(kill_at)})

    if killed and first.returncode not in (-9, 0):
        raise fail(f"the first run exited {first.returncode} before cold change #{kill_at}, where it was to be "
                   "killed", "  stderr:\n" + stderr_tail(first.stderr))
    # Exit 0: it finished with fewer changes than the baseline (uploads merged differently): a
    # whole run, then the node loss, which is still a case worth judging.
    if final.returncode != 0:
        raise fail(f"after the node loss the next start exited {final.returncode}", "  stderr:\n" + stderr_tail(final.stderr))
    if r < bound:
        raise fail(f"after the node loss the next start resumed {resumed_from(r)}; the "
                   f"save of step {bound} had been uploaded (a save before the newest, {saves[-1]}) and should be "
                   "in the cold tier")
    rows = loss_mismatches(baseline.losses, final.losses, session.tolerance(spec))
    if rows:
        raise fail(f"after the node loss the next start resumed from step {r} and diverges: it loaded incomplete "
                   "state from the cold tier", "  first differing steps:\n" + format_mismatches(rows))


def probe_step(baseline: RecordedRun, keep_best: bool) -> tuple[int, str]:
    """The checkpoint a run is later asked to resume from (branch_resume, demotion_safe): the
    best by the metric the trainer logs (keep_best), else its second newest save; 0 if none."""
    saves = baseline.saves()
    if keep_best:
        metrics = _metrics(baseline.ckpt_dir.parent / "baseline-loss.jsonl")
        scored = [(metrics[s], s) for s in saves if s in metrics]
        if scored:
            value, step = min(scored)
            return step, f"the best checkpoint by the metric it logged ({value:.6g})"
    return (saves[-2], "its second newest save") if len(saves) >= 2 else (0, "")


def fault_points(baseline: RecordedRun) -> st.SearchStrategy[ColdFault]:
    """Faults at changes made while the probed checkpoint is uploaded or demoted first (from its
    save to the second save after it, for either probe), then at any change. A garble only where
    a change writes a whole object."""
    changes = cold_changes(baseline)
    if not changes:
        return st.just(ColdFault("kill", 1))
    saves = baseline.saves()
    lo = min(probe_step(baseline, True)[0], probe_step(baseline, False)[0])
    later = [s for s in saves if s > lo]
    hi = later[1] if len(later) > 1 else float("inf")
    near = [c for c in changes if lo <= c.after_step < hi]

    def faults(among):
        kills = [ColdFault("kill", c.n) for c in among]
        garbles = [ColdFault("garble", c.n) for c in among if c.op in WHOLE_OBJECT_WRITES]
        return st.sampled_from(garbles + kills)

    return st.one_of(faults(near), faults(changes)) if near else faults(changes)


def demotion_safe(session: Session, check: str, spec: RunSpec, _param, fault: ColdFault) -> None:
    baseline = session.baseline(spec)
    step, why = probe_step(baseline, session.adapter.has("keep_best"))
    if step == 0:
        raise session.fail(check, spec, f"the run saved fewer than two checkpoints (saves: {baseline.saves()}): "
                           "nothing older to resume from", case={"cold_fault": str(fault)})
    d = session.case_dir("demotion")
    ckpt = (d / "ckpt").resolve()
    ckpt.mkdir()
    what = {"kill": "killed just before", "garble": "one byte of the object written by"}[fault.kind]
    where = f"{what} cold change #{fault.n}" + (" silently flipped" if fault.kind == "garble" else "")

    def fail(problem: str, details: str = ""):
        return session.fail(check, spec, problem, details=f"  fault: {where}\n" + details,
                            case={"cold_fault": str(fault)})

    runs = [session.runner.run_process(session.adapter, spec.but(cold_fault=fault), ckpt, d / "fault-loss.jsonl")]
    # A correct trainer may stop on the fault (a kill, or an upload error it raises): it is
    # started again, at most twice, until it finishes.
    while runs[-1].returncode != 0 and len(runs) < 3:
        runs.append(session.runner.run_process(session.adapter, spec, ckpt, d / f"again{len(runs)}-loss.jsonl"))
    if runs[-1].returncode != 0:
        raise fail(f"after the fault the trainer did not finish in {len(runs) - 1} more start(s): the last exited "
                   f"{runs[-1].returncode}", "  stderr:\n" + stderr_tail(runs[-1].stderr))
    probe = session.runner.run_process(session.adapter, spec.but(resume_from=step), ckpt, d / "probe-loss.jsonl")
    r = probe.resumed_from(spec)
    evidence.record(evidence.Fault(check=check, point=f"cold:{fault}", planned=where, fault=fault.kind,
                                   first_exit=runs[0].returncode, went_on=len(runs) == 1, resumed_from=r,
                                   final_exit=probe.returncode))
    asked = f"then it ran to the end, then CONFORMANCE_RESUME_FROM={step} ({why})"
    if probe.returncode != 0:
        raise fail(f"the trainer could not resume from step {step} (exit {probe.returncode}), a checkpoint it "
                   "keeps in an uninterrupted run: the fault in its upload or demotion lost it (was its hot copy "
                   "deleted before the cold copy was verified?)", f"  {asked}\n  stderr:\n" + stderr_tail(probe.stderr))
    if r != step:
        raise fail(f"asked to resume from step {step}, the trainer resumed from step {r}", f"  {asked}\n")
    rows = loss_mismatches(baseline.losses, probe.losses, session.tolerance(spec))
    if rows:
        raise fail(f"resumed from step {step} after the fault, the trainer diverges from the baseline: it loaded a "
                   "damaged copy of that checkpoint", f"  {asked}\n  first differing steps:\n" + format_mismatches(rows))


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
    step, why = probe_step(baseline, session.adapter.has("keep_best"))
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
    rows = loss_mismatches(baseline.losses, branch.losses, session.tolerance(spec))
    if rows:
        raise fail(f"the new branch from step {step} diverges from the baseline", "  first differing steps:\n"
                   + format_mismatches(rows))
    left = _digests(ckpt, Path(cold_root("file", ckpt))) if spec.cold == "file" else _digests(ckpt)
    gone = sorted(p for p, h in old.items() if h not in left)
    if gone:
        lost = ", ".join(f"{p} (saved at step {old_line_files(baseline)[p]})" for p in gone[:4])
        raise fail(f"the branch wrote over or deleted {len(gone)} file(s) of the line it branched from: {lost}"
                   + (" ..." if len(gone) > 4 else ""))
