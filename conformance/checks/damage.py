"""corruption_detected: each file a resume from the newest checkpoint reads is damaged, one file
per resume, the ways storage damages files; the trainer must notice (fall back, or exit non-zero
with a message), never resume silently wrong.

Every file, not only the largest: a flip that lands in RNG bytes says nothing about the weights
next to them, and a chained checkpoint reads its base's pieces too. The resumes are independent
and run several at once, like crash states: one process per file and damage kind.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..faults.corrupt import corrupt
from ..model import evidence
from ..model.process import ProcessResult, RunSpec
from ..offline.crash_states import Replayer, save_files, with_stand_in_bytes
from ..trace.recording import RecordedRun
from .common import copy_prefix, plot_mismatch, resumed_from
from .failures import format_mismatches, loss_mismatches, max_abs_diff
from .fixes import POINTER_DELETED, CauseFix
from .session import Session
from .states import state_workers


@dataclasses.dataclass(frozen=True)
class Damage:
    """One damaged file and how the trainer took it."""

    file: str                 # relative to the checkpoint directory
    what: str
    result: ProcessResult
    problem: str | None
    details: str = ""
    fix: CauseFix | None = None   # the cause's fix, where the damage says one (fix_for)


def damage_targets(session: Session, spec: RunSpec, newest_files: list[Path], ckpt: Path, stop: int) -> list[str]:
    """The files (relative paths) to damage: every file under the checkpoint directory that a
    resume from the newest checkpoint (of step `stop`) reads, largest first; the newest save's own
    files if the resume's reads are unknown."""
    read = session.files_read_on_resume(spec, stop)
    found = [p for p in sorted(read) if (ckpt / p).is_file() and not (ckpt / p).is_symlink()]
    if not found:
        found = [f.relative_to(ckpt).as_posix() for f in newest_files]
    return sorted(found, key=lambda p: (-(ckpt / p).stat().st_size, p))


def saves_held(run: RecordedRun) -> dict[int, frozenset[str]]:
    """Step s -> the files of save s (crash_states.save_files), for each save whose files are all
    still in the checkpoint directory when the recorded run ends, holding the bytes that save left:
    the checkpoints a resume from that directory can fall back to. A save whose files retention
    deleted, or whose file another save changed, is not held; a file the newest save rewrote under
    the same name (Lightning's `last.ckpt`) is the newest save's, and an older save is held by its
    other files.

    The run need not be recorded with data (crash_states.with_stand_in_bytes)."""
    stand_in = with_stand_in_bytes(run)
    finals = save_files(stand_in)
    end = Replayer()
    for op in stand_in.ops:
        end.apply(op)
    held = {}
    newest = finals.get(max(finals, default=0), {})
    for s, files in sorted(finals.items()):
        # A file the newest save rewrote under the same name (Lightning's `last.ckpt`) is its own.
        own = files if files is newest else {p: data for p, data in files.items() if p not in newest}
        if own and all(end.files.get(p) == data for p, data in own.items()):
            held[s] = frozenset(own)
    return held


def longest_restore_path(session: Session, spec: RunSpec) -> int:
    """Of the last two saves before the end (each leaves an older one to fall back to), the one
    whose resume reads the most files: a chain's delta needs its base and the deltas before it, while
    a full checkpoint needs only itself, so damage drawn from a full newest checkpoint would never
    reach a delta. Learned from the runs, once per session."""
    def compute():
        last = spec.save_every * ((spec.total_steps - 1) // spec.save_every)
        stops = [s for s in (last, last - spec.save_every) if s >= 2 * spec.save_every]
        return max(stops, key=lambda s: (len(session.files_read_on_resume(spec, s)), s)) if len(stops) > 1 else last
    return session._cached(("longest-restore-path", spec), compute)


def fallback_step(held: dict[int, frozenset[str]], stop: int) -> int:
    """The newest checkpoint older than step `stop` that the directory holds whole (0: none, and
    starting from scratch is right when the checkpoint of `stop` is damaged)."""
    return max((s for s in held if s < stop), default=0)


def corruption_detected(session: Session, check: str, spec: RunSpec, kind: str, only: str | None = None) -> int:
    """Damage (truncate, bitflip, delete) each file a resume from the newest checkpoint reads, one
    per resume; for each, the trainer falls back to the newest intact checkpoint that the directory
    really holds (see saves_held; from scratch if it holds none) or exits non-zero with a message.
    Returns the number of files damaged."""
    prefix, stop = session.prefix(spec, longest_restore_path(session, spec))
    held = saves_held(prefix)
    previous = fallback_step(held, stop)
    d0, newest, _ = copy_prefix(session, spec, f"corrupt-{kind}-list", check, stop)
    targets = damage_targets(session, spec, newest, (d0 / "ckpt").resolve(), stop)
    newest_rel = {f.relative_to((d0 / "ckpt").resolve()).as_posix() for f in newest}
    shutil.rmtree(d0, ignore_errors=True)
    if only is not None:
        if only not in targets:
            raise ValueError(f"a resume from step {stop} reads no file {only!r}; it reads: {', '.join(targets)}")
        targets = [only]
    shared = read_by_previous(session, spec, previous, newest_rel)

    def one(rel: str) -> Damage:
        d, _, _ = copy_prefix(session, spec, f"corrupt-{kind}", check, stop)
        ckpt = (d / "ckpt").resolve()
        fix = fix_for(kind, ckpt, rel, stop)   # read before the damage
        what = corrupt(kind, ckpt / rel)
        result = session.runner.run_process(session.adapter, spec, ckpt, (d / "loss.jsonl").resolve())
        needed = rel in shared or rel in held.get(previous, ())   # the fallback is damaged too
        problem, details = judge(session, spec, result, stop, previous, needed)
        if problem is None:
            shutil.rmtree(d, ignore_errors=True)
        return Damage(rel, what, result, problem, details, fix)

    with ThreadPoolExecutor(max_workers=state_workers()) as pool:
        outcomes = list(pool.map(one, targets))
    base = session.baseline(spec)
    for o in outcomes:
        evidence.record(evidence.Corruption(corruption=kind, file=o.file, what=o.what, newest_step=stop,
                                            exit_code=o.result.returncode, resumed_from=o.result.resumed_from(spec),
                                            max_abs_diff=max_abs_diff(base.losses, o.result.losses)))
    failures = [o for o in outcomes if o.problem]
    if failures:
        first = failures[0]
        others = "".join(f"\n    {o.what}: {o.problem}" for o in failures[1:6])
        plot = ""
        if first.result.returncode == 0 and loss_mismatches(base.losses, first.result.losses, session.tolerance(spec)):
            plot = "\n" + plot_mismatch(session, check, spec, extra=kind,
                                        resumed=[(f"resumed after {kind} of {Path(first.file).name}",
                                                  first.result.losses)],
                                        resumes=[first.result.resumed_from(spec)])
        raise session.fail(check, spec, first.problem,
                           details=f"  corruption: {first.what} (newest checkpoint: step {stop}; "
                                   f"{len(failures)} of {len(targets)} damaged files went wrong)"
                                   + first.details + plot
                                   + (f"\n  other damaged files that went wrong:{others}" if others else ""),
                           case={"file": first.file}, fix=first.fix)
    return len(targets)


POINTER_MAX_BYTES = 4096
_TOKEN = re.compile(r"[^\s\"',;{}\[\]<>]+")


def _names_step(text: str, step: int) -> bool:
    """Whether `text` holds the number `step` as a checkpoint name does (`global_step12`,
    `step-00000012`, `epoch=2-step=12.ckpt`, `12`), not inside a hex digest."""
    return re.search(rf"(?<![0-9a-fA-F])0*{step}(?![0-9A-Za-z])", text) is not None


def is_pointer(ckpt: Path, rel: str, stop: int) -> bool:
    """Whether the file `rel` of the checkpoint directory `ckpt` is a pointer: what a trainer reads
    to find the checkpoint to load (`latest`, DeepSpeed's `latest`, Megatron's
    `latest_checkpointed_iteration.txt`, an index of the checkpoints), not a part of one. Its name
    has no step in it, and it is a small text file that holds the newest checkpoint's step alone or
    names an entry of the directory with that step in its name (`step-00000012`, `global_step12`).
    A per-checkpoint manifest (`step-00000012/index.json`) has the step in its own name: not a
    pointer. Read before the damage."""
    path = ckpt / rel
    if _names_step(rel, stop) or path.is_symlink() or not path.is_file() or path.stat().st_size > POINTER_MAX_BYTES:
        return False
    try:
        text = path.read_bytes().decode().strip()
    except (OSError, UnicodeDecodeError):
        return False
    if text.isdigit():
        return int(text) == stop
    names = {p.name for p in ckpt.rglob("*") if p != path}
    return any(_names_step(token, stop) and Path(token).name in names for token in _TOKEN.findall(text))


def fix_for(kind: str, ckpt: Path, rel: str, stop: int) -> CauseFix | None:
    """The fix the failure for damage `kind` to the file `rel` of `ckpt` names in place of the
    check's default (hashes): a deleted pointer (is_pointer, so call it before the damage) asks
    for a loader that finds checkpoints without it, not for hashes."""
    return POINTER_DELETED if kind == "delete" and is_pointer(ckpt, rel, stop) else None


def read_by_previous(session: Session, spec: RunSpec, previous: int, newest: set[str]) -> frozenset[str]:
    """Files a resume from the checkpoint of step `previous` (the one to fall back to) reads too,
    and that the newest save did not write (a chained checkpoint's base, an older manifest):
    damaging one may make that save unusable as well, and falling back further is then right. A
    file the newest save rewrote under the same name (Lightning's `last.ckpt`) is not the previous
    save's. (Damaging one of its own files, see saves_held, does the same.)"""
    if previous < 2 * spec.save_every:
        return frozenset()
    return frozenset(session.files_read_on_resume(spec, previous) - newest)


def judge(session: Session, spec: RunSpec, result: ProcessResult, stop: int, previous: int,
          previous_needs_it: bool) -> tuple[str | None, str]:
    """(what went wrong or None, details) for a resume after one file was damaged."""
    if result.returncode != 0:
        if not result.stderr.strip():
            return f"after corruption the trainer exited {result.returncode} without a message on stderr", ""
        return None, ""
    base = session.baseline(spec)
    r = result.resumed_from(spec)
    rows = loss_mismatches(base.losses, result.losses, session.tolerance(spec))
    if rows and r > 0 and session.same_as_plain_resume(spec, r, result.losses):
        # The trainer resumed from step r exactly as from an undamaged checkpoint: the damage changed
        # nothing it used. (Its divergence is a resume_matches_baseline problem.)
        rows = []
    if rows:
        return ((f"the trainer loaded a corrupted checkpoint without noticing (resumed from step {r}, exit 0) "
                 "and its loss curve diverges"), "\n  first differing steps:\n" + format_mismatches(rows))
    if r < previous and not previous_needs_it:
        what_r = resumed_from(r)
        return ((f"after corruption the trainer resumed {what_r} instead of falling back to the newest intact "
                 f"checkpoint (step {previous})"), "")
    return None, ""
