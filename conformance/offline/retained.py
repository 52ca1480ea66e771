"""Which checkpoints a trainer's own retention keeps, learned from its recorded uninterrupted run,
and the directory a second fault leaves: a kill or a power cut inside a save, then the newest
committed checkpoint damaged (`compound_state`).

A checkpoint of step s is told by the files its save left that no other save writes (a shared
`latest` pointer or a rewritten index says nothing about s); it is present in a directory when
each of them is there with the bytes the save left. What retention promised after committing
step N is what was present in the uninterrupted run once N's save and N's retention pass (on
whatever thread, whenever it landed: saves.retention_passes) were both over."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..trace.recording import RecordedRun, UnreplayableTrace
from . import powerloss
from .crash_states import Replayer, save_files, save_paths


def own_files(run: RecordedRun) -> dict[int, dict[str, bytes]]:
    """Step s -> the files of its checkpoint (crash_states.save_files) that no other save puts
    bytes or a name at, by that very name (save_paths: a directory it renames in brings its files'
    names; one it only made does not make every file in it its, as a store each save adds pieces
    to), with their bytes (empty: a checkpoint that cannot be told apart, such as one file
    overwritten by every save)."""
    finals, put = save_files(run), save_paths(run)
    out = {}
    for s, files in finals.items():
        others = set().union(*(w for t, w in put.items() if t != s))
        out[s] = {p: b for p, b in files.items() if p not in others}
    return out


def present(files: dict[str, bytes | bytearray], own: dict[str, bytes]) -> bool:
    return bool(own) and all(p in files and bytes(files[p]) == b for p, b in own.items())


def kept_after_commits(run: RecordedRun, own: dict[int, dict[str, bytes]] | None = None) -> dict[int, tuple[int, ...]]:
    """Save step N -> the older checkpoints present once N's save and its retention pass were
    over: what the trainer's retention promised to keep beside N. `own`: own_files(run), if the
    caller has it already."""
    own = own_files(run) if own is None else own
    done = {s: idxs[-1] for s, idxs in run.windows().items() if s}
    for i in run.mutations:
        n = run.ops[i].retention
        if n in done:
            done[n] = max(done[n], i)
    ends = {i: s for s, i in done.items()}
    replayer, out = Replayer(), {}
    for op in run.ops:
        replayer.apply(op)
        if op.index in ends:
            n = ends[op.index]
            out[n] = tuple(s for s in sorted(own) if s < n and present(replayer.files, own[s]))
    return out


def promised_beside(run: RecordedRun, damaged: int, own: dict[int, dict[str, bytes]]) -> tuple[int, ...]:
    """The older checkpoints that must all still be there while the save after `damaged` is not
    committed: those kept once `damaged`'s save and retention pass were over, except the ones
    retention removes on a thread other than the logging thread. Which commit set such a removal
    going cannot be seen (torchtitan's purge thread takes paths from a queue, and may act after the
    next save began), so it is never promised: a trainer that makes room before its save on a
    background thread goes unseen here, one that does on its training thread does not."""
    behind = removed_in_background(run, own)
    return tuple(s for s in kept_after_commits(run, own).get(damaged, ()) if s != damaged and s not in behind)


def removed_in_background(run: RecordedRun, own: dict[int, dict[str, bytes]]) -> frozenset[int]:
    """The checkpoints whose files retention removes on a thread that logs no step."""
    views = [run.rank_view(r) for r in sorted(run.ranks)] if run.is_job else [run]
    logging = {(view.ops[0].rank if view.ops else 0, sc.tid) for view in views for sc in view.step_logs.values()}
    out = set()
    for i in run.mutations:
        op = run.ops[i]
        if op.retention and (op.rank, op.tid) not in logging:
            out |= {s for s, files in own.items() if any(f == op.path or f.startswith(op.path + "/") for f in files)}
    return frozenset(out)


def steady_count(run: RecordedRun, own: dict[int, dict[str, bytes]]) -> int:
    """How many checkpoints retention holds at its steady state: the fewest present once a save
    and its retention pass were over, from the first pass that removed a checkpoint on (before it,
    retention was still filling up; without one, it keeps them all). The fewest, because a pass
    on a background thread may land after the next save began and be counted with that one's
    (torchtitan's purge thread): it makes a count too high, never too low. A final save that
    skips retention (torchtitan's last-step save) holds one more, which is no promise either."""
    kept = kept_after_commits(run, own)
    told = sorted(s for s, files in own.items() if files)
    full = [n for n in sorted(kept) if len(kept[n]) < sum(1 for s in told if s < n)]
    if not full:
        return 1 + max((len(older) for older in kept.values()), default=-1)
    return min(1 + len(kept[n]) for n in sorted(kept) if n >= full[0])


def steady(run: RecordedRun, before: list[int]) -> list[int]:
    """Those of the op indices `before` (inside saves) where retention is at its steady state: the
    save they fall in follows a commit beside which retention kept as many older checkpoints as the
    run holds at its end, less one. Only there can a trainer that deletes a restore point before
    its new checkpoint commits be seen holding fewer than it promises."""
    own = own_files(run)
    k = steady_count(run, own)
    kept = kept_after_commits(run, own)
    full = {d for d, older in kept.items() if k > 1 and len([s for s in older if s != d]) >= k - 1}
    wanted = {i for i in before if run.committed_before(i) in full}
    out, replayer = [], Replayer()
    for op in run.ops:   # leave out the states where the save in progress has committed already
        if op.index in wanted and not present(replayer.files, own.get(run.ops[op.index].save, {})):
            out.append(op.index)
        replayer.apply(op)
    return out


@dataclasses.dataclass(frozen=True)
class CompoundState:
    """A fault just before op `before`, then every own file of checkpoint `damaged` truncated to
    half its length. `promised`: the newest older checkpoint retention kept beside it (0: none);
    `promised_intact`: whether the fault left it whole. `missing`: the checkpoints retention keeps
    beside `damaged` (promised_beside) that are gone or damaged in this state although the save in
    progress has not committed: restore points deleted early, even where an older one remains."""

    model: str                       # "kill" or "power" (powerloss's `data` model)
    before: int
    damaged: int
    promised: int
    in_progress: int | None
    in_progress_whole: bool          # the interrupted save's own files are all final already
    files: tuple[str, ...]
    promised_intact: bool = True
    missing: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return str(self.before)


def candidates(run: RecordedRun, model: str = "kill") -> list[int]:
    """Op indices a compound fault can land before: mutations inside a save after which a
    committed checkpoint is left whole to damage (a power cut may leave none: nothing fsynced).
    One replay of the run."""
    own = own_files(run)
    inside = [i for i in run.mutations if run.ops[i].save and run.committed_before(i)]
    if model == "power":
        states = {i: cut.files for i, cut in powerloss.cuts(run, "data") if i in set(inside)}
    else:
        states, replayer, wanted = {}, Replayer(), set(inside)
        for op in run.ops:
            if op.index in wanted:
                states[op.index] = {p: bytes(b) for p, b in replayer.files.items() if not p.startswith("/")}
            replayer.apply(op)
    return [i for i in inside if _committed_here(run, i, states[i], own)]


def left_out(run: RecordedRun, model: str, states: list[int]) -> dict[int, str]:
    """Those of the op indices `states` before which this fault leaves a directory that cannot be
    rebuilt (a file whose bytes the replayer cannot have), with why; every one of them when the
    run itself cannot be replayed (run.unreplayable)."""
    if run.unreplayable:
        return dict.fromkeys(states, run.unreplayable)
    wanted = set(states)
    if model == "power":
        return {i: cut.left_out for i, cut in powerloss.cuts(run, "data") if i in wanted and cut.left_out}
    out, replayer = {}, Replayer()
    for op in run.ops:
        if op.index in wanted and replayer.problem():
            out[op.index] = replayer.problem()
        replayer.apply(op)
    return out


def _committed_here(run: RecordedRun, before: int, files, own: dict[int, dict[str, bytes]]) -> list[int]:
    """The saves whose checkpoint is there, whole, just before op `before`: those whose save ended
    earlier, and the one in progress once all its own files are final (it has committed; the rest
    of its save is retention or syncs)."""
    m = run.ops[before].save
    return [s for s, idxs in run.windows().items() if s and (idxs[-1] < before or s == m)
            and present(files, own.get(s, {}))]


def compound_state(run: RecordedRun, model: str, before: int) -> tuple[CompoundState, dict[str, bytes], set[str],
                                                                       dict[str, str]] | None:
    """The state and the directory (files, directories, symlinks) it leaves, damage applied; None
    when no committed checkpoint is present there to damage. UnreplayableTrace when that directory
    cannot be rebuilt."""
    own = own_files(run)
    if model == "kill":
        if run.unreplayable:
            raise UnreplayableTrace(run.unreplayable)
        replayer = Replayer()
        for op in run.ops[:before]:
            replayer.apply(op)
        if replayer.problem():
            raise UnreplayableTrace(replayer.problem())
        files = {p: bytes(b) for p, b in replayer.files.items() if not p.startswith("/")}
        dirs = {d for d in replayer.dirs if not d.startswith("/")}
        links = dict(replayer.symlinks)
    else:
        cut = powerloss.cut_before(run, "data", before)
        if cut.left_out:
            raise UnreplayableTrace(cut.left_out)
        files, dirs, links = dict(cut.files), set(cut.dirs), dict(cut.symlinks)
    damaged = max(_committed_here(run, before, files, own), default=0)
    if not damaged:
        return None
    kept = [s for s in kept_after_commits(run, own).get(damaged, ()) if s != damaged]
    promised = max(kept, default=0)
    intact = not promised or present(files, own[promised])
    m = run.ops[before].save or None
    m = None if m == damaged else m      # the save in progress had committed: it is the one damaged
    whole = bool(m) and present(files, own.get(m, {}))
    missing = () if not m or whole else tuple(s for s in promised_beside(run, damaged, own) if not present(files, own[s]))
    for p in own[damaged]:
        files[p] = files[p][: len(files[p]) // 2]
    state = CompoundState(model, before, damaged, promised, m, whole, tuple(sorted(own[damaged])), intact, missing)
    return state, files, dirs, links


def materialize(files: dict[str, bytes], dirs: set[str], links: dict[str, str], directory: Path) -> None:
    powerloss.Cut(files, dirs, links, {}, {}).materialize(directory)
