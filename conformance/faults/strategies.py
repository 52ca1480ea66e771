"""Hypothesis strategies for crash schedules. Every drawn value is data: replays are exact."""
from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from ..model.crash import CrashPoint, Schedule
from ..trace.recording import RecordedRun
from ..trace.saves import name_point

# Hypothesis starts from, and shrinks towards, the first element of a sampled list. The lists
# below are ordered so that the first examples are the most telling: a resume from a mid-run,
# mid-epoch checkpoint with steps left to compare, rather than a kill before anything was saved.

def _middle_save(baseline: RecordedRun) -> int:
    n, total = baseline.spec.save_every, baseline.spec.total_steps
    saves = list(range(n, total, n))
    return saves[len(saves) // 2] if saves else 0


def per_rank(baseline: RecordedRun, points, *, nodes: bool = False, writers: bool = False
             ) -> st.SearchStrategy[CrashPoint]:
    """`points(run, rank)` for one process; for a job, for each rank's own run, the rank named
    in every point. The highest rank first (Hypothesis starts from and shrinks towards it): rank 0
    usually coordinates, and a rank that only follows is where a missing barrier or a rank's own
    state left out shows. With `writers`, only the ranks that made an operation a point can name
    (a replicated trainer's rank 0 alone often writes; unless none does). With `nodes`, in a job of
    several nodes, node points come first, the highest node first: each node's loss at the points
    of its first rank."""
    if not baseline.is_job:
        return points(baseline, None)
    chosen = [r for r in sorted(baseline.ranks, reverse=True)
              if not writers or baseline.rank_view(r).crash_points()] or sorted(baseline.ranks, reverse=True)
    ranks = [points(baseline.rank_view(r), r) for r in chosen]
    spec = baseline.spec
    if not nodes or spec.nnodes < 2:
        return st.one_of(*ranks)
    per_node = spec.ranks_per_node
    lost = [points(baseline.rank_view(k * per_node), k * per_node).map(
        lambda p, k=k: dataclasses.replace(p, node=k)) for k in range(spec.nnodes - 1, -1, -1)
        if k * per_node in baseline.ranks]
    return st.one_of(*lost, *ranks)


def step_points(baseline: RecordedRun, *, nodes: bool = False) -> st.SearchStrategy[CrashPoint]:
    last = max(1, baseline.spec.total_steps - 1)
    pivot = _middle_save(baseline) + 1
    ordered = sorted(range(1, last + 1), key=lambda k: (k < pivot, abs(k - pivot)))
    return per_rank(baseline, lambda _, r: st.sampled_from(ordered).map(lambda k: CrashPoint("step", k, r)),
                    nodes=nodes)


def after_save_points(baseline: RecordedRun) -> st.SearchStrategy[CrashPoint]:
    """Kills at a step boundary right after a save committed, newest save first (the one whose
    number has the most digits: `ckpt-12` against `ckpt-9`), then the other steps, latest first."""
    n, total = baseline.spec.save_every, baseline.spec.total_steps
    saves = list(range(n, total, n))
    others = [k for k in range(total - 1, 0, -1) if k not in saves]
    return per_rank(baseline, lambda _, r: st.sampled_from(saves[::-1] + others or [1]).map(
        lambda k: CrashPoint("step", k, r)))


def _ordered_fs(baseline: RecordedRun, only_inside: bool, from_end: bool = False) -> list[int]:
    """Ordinals into the targetable mutations (`run.crash_points()`), most telling first; with
    `from_end`, each save's writes from its last one backwards, then its other operations."""
    targetable = baseline.crash_points()
    owner = {k: baseline.ops[baseline.mutations[k]].save for k in targetable}
    pivot = _middle_save(baseline)
    ordinals = [n for n, k in enumerate(targetable) if not only_inside or owner[k]]
    if not ordinals:
        ordinals = list(range(len(targetable)))
    # The middle save's operations first, from the middle of that save outwards (where a save is
    # most likely to be half done: old state gone or new state partial), then later saves, then
    # earlier ones.
    in_pivot = [n for n in ordinals if owner[targetable[n]] == pivot]
    centre = (in_pivot[0] + in_pivot[-1]) / 2 if in_pivot else 0
    if from_end:
        # A save's data writes, and the fsyncs of the files they wrote, from the last one
        # backwards, then its other operations: the last writes are where a rank's part is still
        # incomplete while the others may be done. The fsync after a file's last write comes
        # first: it is as telling, and its count, unlike a job's write count (gloo's wake-up
        # writes), does not drift, so a kill by count lands there exactly.
        ops = [baseline.ops[baseline.mutations[targetable[n]]] for n in ordinals]
        written = {op.path for op in ops if op.kind == "write"}
        writes = {n for n, op in zip(ordinals, ops) if op.kind == "write" or (op.kind == "fsync" and op.path in written)}
        return sorted(ordinals, key=lambda n: (owner[targetable[n]] != pivot, owner[targetable[n]] < pivot,
                                               owner[targetable[n]], n not in writes, -n))
    return sorted(ordinals, key=lambda n: (owner[targetable[n]] != pivot, owner[targetable[n]] < pivot,
                                           abs(n - centre) if n in in_pivot else n))


def named(run: RecordedRun, ordinals: list[int], rank: int | None) -> list[CrashPoint]:
    """The crash points at these ordinals (into `run.crash_points()`), in order, each named by its
    save and thread where it has one (saves.name_point), so a replay finds the same operation."""
    targetable = run.crash_points()
    return [name_point(run, targetable[n], rank) for n in ordinals] or [CrashPoint("fs", 0, rank)]


def first_in_save_point(run: RecordedRun, rank: int | None = None) -> CrashPoint:
    """The most telling point inside a save of `run` (a process's or a rank's own run): the
    first a check draws, and what a benchmark's trial kills at."""
    return named(run, _ordered_fs(run, True)[:1], rank)[0]


def fs_points(baseline: RecordedRun) -> st.SearchStrategy[CrashPoint]:
    return per_rank(baseline, lambda run, r: st.sampled_from(named(run, _ordered_fs(run, False), r)), writers=True)


def in_save_points(baseline: RecordedRun) -> st.SearchStrategy[CrashPoint]:
    """Points at operations inside a save (after some step was logged), where torn state lives."""
    return per_rank(baseline, lambda run, r: st.sampled_from(named(run, _ordered_fs(run, True), r)), writers=True)


def save_end_points(baseline: RecordedRun, *, nodes: bool = False) -> st.SearchStrategy[CrashPoint]:
    """In-save points of every rank, each save from its end backwards: where a rank that follows
    finishes its part after (or without) the commit, and a missing barrier or a per-rank commit
    shows. With `nodes`, a whole node lost there too (per_rank)."""
    return per_rank(baseline, lambda run, r: st.sampled_from(named(run, _ordered_fs(run, True, from_end=True), r)),
                    nodes=nodes, writers=True)


def node_points(baseline: RecordedRun) -> st.SearchStrategy[CrashPoint]:
    """Whole-node losses, in a job of several nodes: at the in-save points of each node's first
    rank (each save from its end backwards), or at a step; the highest node first."""
    spec = baseline.spec
    per = spec.ranks_per_node

    def lost(k: int) -> st.SearchStrategy[CrashPoint]:
        run = baseline.rank_view(k * per)
        steps = st.sampled_from(range(1, max(2, spec.total_steps))).map(lambda s: CrashPoint("step", s, k * per))
        if run.crash_points():   # a node whose first rank writes nothing is lost at a step
            steps = st.one_of(st.sampled_from(named(run, _ordered_fs(run, True, from_end=True), k * per)), steps)
        return steps.map(lambda p: dataclasses.replace(p, node=k))
    return st.one_of(*[lost(k) for k in range(spec.nnodes - 1, -1, -1) if k * per in baseline.ranks])


def later_points(ranks: list[int | None] | None = None) -> st.SearchStrategy[CrashPoint]:
    """Points for a resumed process, whose trace is not known in advance: fs indices wrap. For a
    job, on any of `ranks`."""
    rank = st.sampled_from(ranks or [None])
    return st.one_of(st.tuples(st.integers(0, 40), rank).map(lambda ir: CrashPoint("fs", *ir)),
                     st.tuples(st.integers(1, 11), rank).map(lambda kr: CrashPoint("step", *kr)))


def schedules(baseline: RecordedRun, *, max_crashes: int = 2) -> st.SearchStrategy[Schedule]:
    first = st.one_of(step_points(baseline), fs_points(baseline))
    rest = st.lists(later_points(sorted(baseline.ranks) if baseline.is_job else None), max_size=max_crashes - 1)
    return st.tuples(first, rest).map(lambda fr: (fr[0], *fr[1]))


def error_points(baseline: RecordedRun, error: str) -> st.SearchStrategy[CrashPoint]:
    """Writes, syncs and namespace changes inside a save (faults.error_points), most telling
    first: the middle save, and in it the calls this error most often hits (a full disk fails
    writes; network storage reports EIO at fsync)."""
    from .injection import error_points as injectable
    first = ("write", "pwrite64", "writev") if error == "enospc" else ("fsync", "fdatasync")

    def points(run: RecordedRun, rank: int | None) -> st.SearchStrategy[CrashPoint]:
        allowed = set(injectable(run))
        kind = {n: run.ops[run.mutations[run.crash_points()[n]]].syscall for n in allowed}
        ordered = [n for n in _ordered_fs(run, True) if n in allowed]
        ordered.sort(key=lambda n: kind[n] not in first)   # stable: the middle save stays first in each group
        return st.sampled_from(named(run, ordered, rank))
    return per_rank(baseline, points, writers=True)


def term_points(baseline: RecordedRun) -> st.SearchStrategy[CrashPoint]:
    """Where a scheduler's SIGTERM arrives: inside a save, or between steps."""
    return st.one_of(in_save_points(baseline), step_points(baseline))
