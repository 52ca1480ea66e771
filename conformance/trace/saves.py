"""Which save each recorded operation belongs to, and on which of its threads: a save is a logical
unit learned from the run, not the window between two log lines (a save in flight across steps
commits whenever its background write is done). `recording.build` asks `attribute_saves`."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..model.crash import CrashPoint

if TYPE_CHECKING:
    from .recording import Op, RecordedRun

_COMMIT_LIKE = frozenset({"rename", "link", "symlink", "unlink", "rmdir"})
_BRINGS_DATA = frozenset({"create", "mkdir", "write", "copy", "link", "symlink"})
_REMOVES = frozenset({"unlink", "rmdir"})


def attribute_saves(ops: list[Op], main_tid: int, save_every: int) -> list[Op]:
    """Each operation with the save it belongs to (`save`) and its thread within it (`lane`).

    - The logging thread's operations between logging step s and s+1 are the save of step s.
    - Another thread that brings new data (creates, writes, links) is writing a save in flight,
      whenever its commit lands. It belongs to the save whose files it touches (a file or
      directory the newest save created), else to the oldest save step (a multiple of SAVE_EVERY,
      as the command contract has it) already logged that no save has taken yet; with none left,
      to the newest save (a second writer thread of it). Such a thread begins a new save when it
      creates a file or directory after a commit-like operation (rename, link, symlink, unlink,
      rmdir, a directory fsync) while a logged save step is still untaken.
    - Another thread that only removes or syncs (retention, demotion to a cold tier) belongs to
      the step window it runs in, as the logging thread's operations do (lane 0).
    - The logging thread's operations on the files of a save in flight (its commit, once the
      background write finished) belong to that save, with the ones after them at the same step
      until it creates something (the next save begins).
    - Removing files takes no save: a save exists only where the trainer writes what a commit
      makes real. Removing an older checkpoint's files is retention (`retention_passes`).
    Neither a wall clock nor how far the background thread lags decides anything, so every run of
    a deterministic trainer gets the same attribution, provided it takes every save step in
    order (at most one save in flight, none skipped)."""
    every = max(1, save_every)
    dirs = {"."}
    owner: dict[str, int] = {}          # path -> the save that created it
    current: dict[int, int] = {}        # thread -> the save its operations belong to now
    previous: dict[int, Op] = {}        # thread -> its last operation
    taken: set[int] = set()             # save steps some save already took
    newest = 0                           # the newest save so far
    in_flight = 0                        # the newest save begun on another thread
    finishing: tuple[int, int] | None = None   # (save, step): the main thread is committing that save
    lanes: dict[int, dict[int, int]] = {}   # save -> thread -> lane
    out: list[Op] = []

    def untaken(logged: int) -> int | None:
        return next((c for c in range(every, logged + 1, every) if c not in taken), None)

    for op in ops:
        if op.kind == "log":
            out.append(op)
            continue
        made = max(owner.get(op.path, 0), owner.get(op.path.rpartition("/")[0] or ".", 0))
        lane = 0
        if op.tid == main_tid:
            w = save = op.after_step
            if in_flight and made == in_flight != save:
                finishing = (in_flight, w)     # the main thread commits the save in flight
            elif finishing is not None and (finishing[1] != w or op.kind in ("create", "mkdir")):
                finishing = None
            if finishing is not None:
                save = finishing[0]
        else:
            before = previous.get(op.tid)
            free = untaken(op.after_step)
            brings = op.kind in _BRINGS_DATA
            if brings and made and made >= newest and made > current.get(op.tid, 0):
                current[op.tid] = made
            elif op.tid not in current:
                if brings:
                    current[op.tid] = free if free is not None else newest
            elif free is not None and op.kind in ("create", "mkdir") and before is not None and (
                    before.kind in _COMMIT_LIKE or (before.kind == "fsync" and before.path in dirs)):
                current[op.tid] = free
            save = current.get(op.tid, op.after_step)
            if op.tid in current:
                in_flight = max(in_flight, save)
                threads = lanes.setdefault(save, {main_tid: 0})
                lane = threads.setdefault(op.tid, len(threads))
        if op.mutation and save and op.kind not in _REMOVES:
            taken.add(save)
            newest = max(newest, save)
        if op.kind == "mkdir":
            dirs.add(op.path)
        if op.kind in ("create", "mkdir"):
            owner[op.path] = save
        if op.kind in ("rename", "link") and op.target:
            owner[op.target] = save
        if op.mutation:
            previous[op.tid] = op
        out.append(dataclasses.replace(op, save=save, lane=lane))
    return retention_passes(out, taken)


def retention_passes(ops: list[Op], saves: set[int]) -> list[Op]:
    """`ops` (attributed to saves) with retention told apart: an operation that removes a file or
    directory an older save made (or one there before the run: an earlier process's checkpoint),
    and that its own save does not make again (a pointer replaced by unlink and create is part of
    a commit), is retention, on whatever thread it runs. It belongs to the retention pass of the
    newest save begun by the step it runs after (`retention`), not to any save: which commit set
    a background deletion going, and when it lands, are races; what it deletes is not. Removals
    that are neither part of a save nor retention belong to no save (0)."""
    owner: dict[str, int] = {}
    made_at: dict[tuple[int, str], list[int]] = {}   # (save, path) -> where that save (re)made it
    for op in ops:
        for p in _made(op):
            made_at.setdefault((op.save, p), []).append(op.index)
    order = sorted(saves)
    out = []
    for op in ops:
        changed = op
        if op.mutation and op.kind in _REMOVES:
            # A save's own thread removing what it made (a directory renamed out of the way, then
            # emptied) stays in that save however far the main thread has logged meanwhile.
            upto = op.save if op.save in saves else max(op.after_step, op.save)
            begun = max((s for s in order if s <= upto), default=0)
            made = _owner_of(owner, op.path)
            again = any(i > op.index for i in made_at.get((op.save, op.path), ()))
            if begun and made < begun and not again:
                changed = dataclasses.replace(op, save=0, lane=0, retention=begun)
            elif op.save not in saves:
                changed = dataclasses.replace(op, save=0, lane=0)
        for p in _made(op):
            owner[p] = op.save
        out.append(changed)
    return out


def _made(op: Op) -> tuple[str, ...]:
    if op.kind in ("create", "mkdir", "symlink"):
        return (op.path,)
    if op.kind in ("rename", "link") and op.target:
        return (op.target,)
    return ()


def _owner_of(owner: dict[str, int], path: str) -> int:
    """The save that made `path` or, failing that, its nearest enclosing directory (0: there before
    the run, or made outside any save)."""
    while path:
        if path in owner:
            return owner[path]
        path = path.rpartition("/")[0]
    return 0


def surely_committed_by(windows: dict[int, list[int]], ops, save_every: int, total_steps: int) -> dict[int, int]:
    """Save -> the step by whose log line it is surely committed: its last operation's, if the
    logging thread made it; a background thread's commit races the log lines until the next save
    step (at most one save in flight: the trainer waits for it there) or the end of the run."""
    out = {}
    for s, idxs in windows.items():
        last = ops[idxs[-1]]
        if s:
            out[s] = last.after_step if not last.lane else max(last.after_step, min(s + save_every, total_steps))
    return out


def name_point(run: RecordedRun, k: int, rank: int | None = None) -> CrashPoint:
    """The crash point at mutation `k` of `run` (a process's or a rank's own run), named by its
    save and thread (`save:s/tL/i`), or its retention pass (`retention:s/i`), so that a replay
    finds the same operation however threads interleave; an operation outside both by its
    position among the mutations (`fs:k`)."""
    i = run.mutations[k]
    op = run.ops[i]
    if op.retention:
        return CrashPoint("retention", op.retention, rank, op=run.position_in_pass(i))
    if not op.save:
        return CrashPoint("fs", k, rank)
    return CrashPoint("save", op.save, rank, op=run.position_in_save(i), thread=op.lane)


def locate_point(run: RecordedRun, point: CrashPoint) -> int | None:
    """The mutation (its position in `run.mutations`) a save or retention point names in `run` (a process's or
    a rank's own run), or None when that save has no such operation on that thread, or a kill by
    count there could land elsewhere (not targetable)."""
    if point.kind == "retention":
        lane = run.retention_ops(point.index, point.on_rank)
    else:
        lane = run.thread_ops(point.index, point.thread, point.on_rank)
    if point.op > len(lane) or not run.ops[lane[point.op - 1]].targetable:
        return None
    return run.mutations.index(lane[point.op - 1])
