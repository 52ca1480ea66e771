"""The model of what one traced run did: the one owner of "which operations, in which save, and
which saves were committed before operation i".

A `RecordedRun` is built from the syscalls `strace.parse` returns: every filesystem operation under
the checkpoint directory in order (with its bytes, when the run was recorded with data), files
written elsewhere and later renamed in, the loss-log writes that mark step boundaries, and the
files a run opened for reading. Scenarios, crash states, strategies and the checks ask it; none
of them reads a trace or recomputes these facts.

A save is a logical unit learned from the run (saves.py; in flight across steps too), committed
before operation i when all of its operations come before i.

It is also the one owner of "what the trace wrote": a copy, link or rename that brings in a file
from outside it (DeepSpeed's `zero_to_fp32.py`, copied from site-packages by every save) carries
that file's `SourceFile`, its size, mtime and sha256 taken right after the run (`with_sources`);
the offline replayers read its bytes back from disk, and only while they are unchanged.

A multi-rank job is recorded rank by rank (each rank's own trace, its own steps) and merged into
one run in the order the operations happened (strace's -ttt entry times, one clock for all
ranks): a save is then every rank's operations for that step, committed before operation i when
every rank's part comes before i. Each rank's own run stays available (`rank_view`): kills and
injections are planned on it, and two runs are aligned rank by rank.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import stat
from pathlib import Path

from ..model.process import ProcessResult, RunSpec, rank_log
from . import strace
from .operations import MUTATIONS, Op, Translator  # noqa: F401  (Op, MUTATIONS: the run's vocabulary, re-exported)
from .saves import attribute_saves, surely_committed_by


class UnreplayableTrace(Exception):
    """The recorded run did something the offline replayer cannot rebuild exactly (named)."""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """A file that a copy, link or rename brought into the checkpoint directory from outside what
    the trace wrote (DeepSpeed's `zero_to_fp32.py`, a tokenizer, a config): the trace holds none of
    its bytes, so a rebuilt state reads them from disk, and only while they are what they were when
    the run was recorded (its size, mtime and sha256 then)."""

    path: str                # the file the run copied, linked or renamed (absolute)
    at: str                  # where its bytes lay when the run ended (a rename moved them into the directory)
    size: int = -1
    mtime_ns: int = -1
    sha256: str = ""
    directory: bool = False  # a directory renamed in: its files are not recorded
    problem: str = ""        # why its bytes could not be recorded ("" when they were)

    def read(self) -> bytes:
        """Its bytes; UnreplayableTrace when they are gone, or changed since the run was recorded."""
        if self.problem:
            raise UnreplayableTrace(self.problem)
        try:
            now = os.stat(self.at)
        except OSError as exc:
            raise UnreplayableTrace(f"{self.where()} is gone since the run was recorded ({exc.strerror})") from None
        if (now.st_size, now.st_mtime_ns) != (self.size, self.mtime_ns):
            raise UnreplayableTrace(f"{self.where()} changed since the run was recorded (size {self.size} -> "
                                    f"{now.st_size} bytes, mtime {self.mtime_ns} -> {now.st_mtime_ns} ns)")
        data, digest = _read_hashed(self.at, now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns)
        if digest != self.sha256:
            raise UnreplayableTrace(f"{self.where()} changed since the run was recorded (same size and mtime, "
                                    f"but its sha256 is {digest[:12]}..., not {self.sha256[:12]}...)")
        return data

    def where(self) -> str:
        return f"`{self.path}`" + (f" (renamed to `{self.at}` by the run)" if self.at != self.path else "")


def outside_bytes(op) -> tuple[bytes, str] | None:
    """The bytes `op` (a copy, link or rename) brings in from outside what the trace wrote, and ""
    or why they cannot be had (the replayers' one rule for such a source); None when its source is
    one the trace wrote."""
    if op.source is None:
        return None
    try:
        return op.source.read(), ""
    except UnreplayableTrace as exc:
        return b"", f"op #{op.index} ({op.describe()}): {exc}"


@functools.lru_cache(maxsize=8)
def _read_hashed(path: str, dev: int, ino: int, size: int, mtime_ns: int, ctime_ns: int) -> tuple[bytes, str]:
    """A file's bytes and their sha256, read once per version of it (any write changes its ctime):
    every rebuilt state that holds a copy of it reads it again."""
    with open(path, "rb") as f:
        data = f.read()
    return data, hashlib.sha256(data).hexdigest()


def record_source(path: str, at: str) -> SourceFile:
    """The source `path` of a copy, link or rename from outside the trace, its bytes now at `at`:
    its size, mtime and sha256 as they are now (right after the run)."""
    try:
        now = os.stat(at)
        if stat.S_ISDIR(now.st_mode):
            return SourceFile(path, at, directory=True, problem=f"`{path}` is a directory brought in from outside "
                              "what the trace wrote: the files in it are not recorded")
        if not stat.S_ISREG(now.st_mode):
            return SourceFile(path, at, problem=f"`{path}` is not a regular file, so its bytes cannot be recorded")
        if now.st_size > strace.MAX_DATA_BYTES:   # the replayers hold every file in memory, as for a write
            return SourceFile(path, at, problem=f"`{path}` is larger than {strace.MAX_DATA_BYTES} bytes ({now.st_size}): "
                              "files that large cannot be replayed")
        _, digest = _read_hashed(at, now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns)
    except OSError as exc:
        return SourceFile(path, at, problem=f"`{at}` could not be read when the run was recorded ({exc.strerror})")
    return SourceFile(path, at, now.st_size, now.st_mtime_ns, digest)


@dataclasses.dataclass
class RecordedRun:
    """One traced, uninterrupted (or killed) trainer process and everything it did."""

    spec: RunSpec
    result: ProcessResult
    ckpt_dir: Path
    ops: tuple[Op, ...]
    step_logs: dict[int, strace.Syscall]     # step k -> the loss-log write that logged it
    reads: frozenset[str]                    # files under the checkpoint directory opened for reading
    preexisting: frozenset[str] = frozenset()  # relative paths present before the run
    unreplayable: str | None = None          # why crash states cannot be rebuilt from this run
    ranks: dict[int, RecordedRun] = dataclasses.field(default_factory=dict)   # jobs: each rank's own run
    # (syscall, nth) two threads reached (any call): a fault by that count hits whichever is first
    shared_counts: frozenset[tuple[str, int]] = frozenset()

    is_job = property(lambda self: bool(self.ranks), doc="a multi-rank job (its ranks' runs merged)")

    @property
    def threaded(self) -> bool:
        """Several threads made the recorded calls (strace counts per thread: faults go by path)."""
        return len({op.tid for op in self.ops} | {sc.tid for sc in self.step_logs.values()}) > 1

    def rank_view(self, rank: int) -> RecordedRun:
        """Rank `rank`'s own run (a single process is its own rank 0)."""
        if not self.ranks:
            if rank:
                raise KeyError(f"a single-process run has no rank {rank}")
            return self
        return self.ranks[rank]

    def merged_index(self, rank: int, local: int) -> int:
        """The index in this (merged) run of op `local` of rank `rank`'s own run."""
        if not self.ranks:
            return local
        return self._merged[(rank, local)]

    @functools.cached_property
    def _merged(self) -> dict[tuple[int, int], int]:
        return {(op.rank, op.local): op.index for op in self.ops}

    # -- the run's operations and saves -------------------------------------------------------------
    @property
    def losses(self) -> dict[int, float]:
        return self.result.losses

    @functools.cached_property
    def mutations(self) -> list[int]:
        """Op indices of the mutations under the checkpoint directory: `fs:i` counts these."""
        return [op.index for op in self.ops if op.mutation]

    def crash_points(self) -> list[int]:
        """Positions (into `mutations`) that a syscall-level injection can hit exactly."""
        return [k for k, i in enumerate(self.mutations) if self.ops[i].targetable]

    def fs_target(self, i: int) -> int | None:
        """The mutation (its position in `mutations`) that `fs:i` names: mutation i, wrapping
        around, or the first one after it that an injection can hit; None if none can be hit.
        Counted over all mutations, not over the hittable ones, because which ones a kill by count
        can hit depends on one-time work of the process (a library's lazy probe adds a write to a
        thread's count), so an ordinal among them would name another operation in a process that
        did that work earlier, while the mutations themselves are the trainer's."""
        if not self.mutations:
            return None
        n = len(self.mutations)
        return next((k % n for k in range(i % n, i % n + n) if self.ops[self.mutations[k % n]].targetable), None)

    @functools.cached_property
    def _windows(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i in self.mutations:
            out.setdefault(self.ops[i].save, []).append(i)
        return out

    def windows(self) -> dict[int, list[int]]:
        """Step s -> op indices of the mutations of the save of step s (0: outside any save), in
        the order they happened."""
        return self._windows

    def saves(self) -> list[int]:
        """Steps whose save wrote something, in order."""
        return sorted(s for s in self.windows() if s)

    def committed_before(self, op_index: int) -> int:
        """The newest save all of whose operations come before op `op_index` (0: none)."""
        return max((s for s, idxs in self.windows().items() if s and idxs[-1] < op_index), default=0)

    def settled_before(self, op_index: int) -> int:
        """The newest save all of whose operations but its syncs come before op `op_index`: what a
        kill leaves there holds it whole (a kill keeps the page cache), though a sync of it may still
        come after another save's operation (a job's ranks, a commit on a background thread)."""
        return max((s for s, idxs in self.windows().items()
                    if s and all(i < op_index or self.ops[i].kind == "fsync" for i in idxs)), default=0)

    def committed_by_step(self, step: int) -> int:
        """The newest save surely finished when step `step` + 1 is about to be logged (0: none)."""
        return max((s for s, by in self._sure_by.items() if by <= step), default=0)

    def in_flight_by_step(self, step: int) -> int | None:
        """The save begun by step `step`, not surely committed as `step` + 1 is logged (or None)."""
        return max((s for s, by in self._sure_by.items() if s <= step < by), default=None)

    @functools.cached_property
    def _sure_by(self) -> dict[int, int]:
        return surely_committed_by(self.windows(), self.ops, self.spec.save_every, self.spec.total_steps)

    def in_progress(self, op_index: int) -> int | None:
        """The save op `op_index` belongs to; for an operation of no save (retention), the save
        whose operations began before it and end after it (a retention pass between a commit and
        the save's last sync); else None."""
        own = self.ops[op_index].save
        if own:
            return own
        return max((s for s, idxs in self.windows().items() if s and idxs[0] < op_index < idxs[-1]), default=None)

    def thread_ops(self, save: int, lane: int, rank: int = 0) -> list[int]:
        """Op indices of the mutations of the save of step `save` on its thread `lane` (rank
        `rank`'s, in a merged job run), in order: what a save point's position counts."""
        return [i for i in self.windows().get(save, []) if self.ops[i].lane == lane and self.ops[i].rank == rank]

    def retention_ops(self, save: int, rank: int = 0) -> list[int]:
        """Op indices of the retention pass after the save of step `save` (rank `rank`'s), in order."""
        return [i for i in self.windows().get(0, []) if self.ops[i].retention == save and self.ops[i].rank == rank]

    def position_in_pass(self, op_index: int) -> int:
        """1-based position of op `op_index` in its retention pass."""
        me = self.ops[op_index]
        return self.retention_ops(me.retention, me.rank).index(op_index) + 1

    def position_in_save(self, op_index: int) -> int:
        """1-based position of op `op_index` among its save's mutations on its thread (its rank's,
        in a job): the same in every run, however threads interleave."""
        me = self.ops[op_index]
        return self.thread_ops(me.save, me.lane, me.rank).index(op_index) + 1

    def role(self, op_index: int) -> str:
        """What an operation is, independent of run-random names and of how threads interleave:
        its place in its save, on its thread."""
        op, s = self.ops[op_index], self.ops[op_index].save
        who = f"rank {op.rank}'s " if self.ranks else ""
        if op.retention:
            return (f"{who}{op.kind} #{self.position_in_pass(op_index)} of the retention pass after the save of "
                    f"step {op.retention}")
        where = f"the save of step {s}" if s else f"no save (after step {op.after_step})" if op.after_step \
            else "the start of the run"
        thread = f" (background thread {op.lane})" if op.lane else ""
        return f"{who}{op.kind} #{self.position_in_save(op_index)} of {where}{thread}"

    @functools.cached_property
    def kept(self) -> dict[int, str]:
        """What retention left once the run was over: each save's checkpoint "kept" (every file and
        directory its save left is still there), "partly" kept, or "removed"."""
        live: set[str] = set(self.preexisting)
        ends = {idxs[-1]: s for s, idxs in self.windows().items() if s}
        made: dict[int, set[str]] = {}
        left: dict[int, frozenset[str]] = {}
        for op in self.ops:
            if not op.mutation or op.error or not op.effect:
                continue
            if op.kind in ("create", "mkdir", "symlink"):
                live.add(op.path)
            elif op.kind in ("unlink", "rmdir"):
                live.discard(op.path)
            elif op.kind == "rename" and op.target:
                moved = {p for p in live if p == op.path or p.startswith(op.path + "/")}
                live -= moved
                live |= {op.target + p[len(op.path):] for p in moved} | {op.target}
            elif op.kind == "link" and op.target:
                live.add(op.target)
            if op.save and op.kind in ("create", "mkdir", "symlink", "rename", "link"):
                made.setdefault(op.save, set()).add(op.target if op.kind in ("rename", "link") else op.path)
            if op.index in ends:
                s = ends[op.index]
                left[s] = frozenset(p for p in made.get(s, ()) if p in live)
        out = {}
        for s, paths in sorted(left.items()):
            there = sum(p in live for p in paths)
            out[s] = "kept" if there == len(paths) else "removed" if not there else "partly"
        return out

    def committed_at(self, ts: float) -> int:
        """The newest save all of whose operations (every rank's) were entered before time `ts`."""
        return max((s for s, idxs in self.windows().items() if s and self.ops[idxs[-1]].ts < ts), default=0)

    def log_writes_until(self, step: int) -> int:
        """How many writes to its loss log the process (a rank) makes up to the one that logs
        `step`: the count a delivery on the loss log names."""
        return sum(1 for sc in self.step_logs.values() if sc.seq <= self.step_logs[step].seq)

    def killed_op(self) -> Op | None:
        return next((op for op in self.ops if op.killed), None)

    def signalled_op(self) -> Op | None:
        """The operation the suite injected a signal (SIGTERM) into, if any."""
        return next((op for op in self.ops if op.signalled), None)

    def failed_op(self) -> Op | None:
        """The operation the suite injected an error into, if any."""
        return next((op for op in self.ops if op.error), None)


def from_result(result: ProcessResult, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                preexisting: frozenset[str] = frozenset()) -> RecordedRun:
    """The model of a traced process or job from what it left (its trace texts are dropped from
    `result` once parsed: a recording's text can be large)."""
    if not spec.is_job:
        run = build(strace.parse(result.trace_text), spec, result, ckpt_dir, loss_log, preexisting=preexisting)
        result.trace_text = ""
        return run
    views = {}
    for r, text in sorted(result.traces.items()):
        own = dataclasses.replace(result, losses=result.rank_losses[r] if r < len(result.rank_losses) else {},
                                  rank_losses=(), traces={}, trace_text="")
        views[r] = build(strace.parse(text), spec, own, ckpt_dir, rank_log(loss_log, r, spec.world_size), preexisting=preexisting,
                         rank=r)
    result.traces = {}
    return merge(views, spec, result, ckpt_dir, preexisting)


def merge(views: dict[int, RecordedRun], spec: RunSpec, result: ProcessResult, ckpt_dir: Path,
          preexisting: frozenset[str]) -> RecordedRun:
    """One run from the runs of a job's ranks, its operations in the order they were entered."""
    ops = sorted((op for view in views.values() for op in view.ops), key=lambda op: (op.ts, op.rank, op.local))
    ops = [dataclasses.replace(op, index=i) for i, op in enumerate(ops)]
    reads = frozenset().union(*(v.reads for v in views.values())) if views else frozenset()
    problems = [f"rank {r}: {v.unreplayable}" for r, v in sorted(views.items()) if v.unreplayable]
    first = views[min(views)] if views else None
    return RecordedRun(spec, result, Path(ckpt_dir), tuple(ops), first.step_logs if first else {}, reads,
                       preexisting, "; ".join(problems) or None, ranks=dict(views))


def build(syscalls: list[strace.Syscall], spec: RunSpec, result: ProcessResult, ckpt_dir: Path,
          loss_log: Path, *, preexisting: frozenset[str] = frozenset(), rank: int | None = None) -> RecordedRun:
    """The model of a run (or of one rank's process, with `rank`) from its parsed trace."""
    t = Translator(syscalls, str(ckpt_dir), str(loss_log), result.losses, rank).run(syscalls)
    step_logs, unreplayable = t.step_logs, t.unreplayable
    ops = with_sources(t.ops, Path(ckpt_dir))
    # Operations elsewhere matter only for files whose bytes end up under the root: drop the rest.
    feeding = _feeding(ops)
    unreplayable += [f"a shared writable mmap of {p} (its writes are not syscalls)" for p in sorted(t.mapped)
                     if not p.startswith("/") or p in feeding]
    kept = [op for op in ops if op.inside or op.kind == "log"
            or any(op.path == f or op.path.startswith(f + "/") for f in feeding)]
    kept = [dataclasses.replace(op, index=i, local=i if rank is not None else -1) for i, op in enumerate(kept)]
    logging_tids = {sc.tid for sc in step_logs.values()}
    main_tid = min(logging_tids) if logging_tids else (syscalls[0].tid if syscalls else 0)
    kept = attribute_saves(kept, main_tid, spec.save_every)
    return RecordedRun(spec, result, Path(ckpt_dir), tuple(kept), step_logs, frozenset(t.reads), preexisting,
                       "; ".join(dict.fromkeys(unreplayable)) or None, shared_counts=t.shared_counts())


def _brought_from(op: Op) -> str | None:
    """The path outside the root whose bytes `op` brings under it (a copy's source, a link's or a
    rename's origin), or None."""
    if op.error or not op.effect:
        return None
    if op.kind == "copy" and op.inside and op.target.startswith("/"):
        return op.target
    if op.kind in ("rename", "link") and op.path.startswith("/") and not op.target.startswith("/"):
        return op.path
    return None


def _puts(op: Op) -> str | None:
    """The path whose bytes or name `op` sets (a directory: everything under it), or None."""
    if op.error or not op.effect:
        return None
    if op.kind in ("rename", "link"):
        return op.target
    return op.path if op.kind in ("mkdir", "create", "open", "write", "copy", "truncate", "symlink") else None


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top + "/")


def _feeding(ops: list[Op]) -> set[str]:
    """The paths outside the root whose bytes the trace wrote and that reach the root: a copy's,
    link's or rename's origin, and, through renames, links and copies outside it, theirs."""
    out = {p for op in ops if (p := _brought_from(op)) is not None and not op.source}
    outside = [(op.target, op.path) if op.kind == "copy" else (op.path, op.target) for op in ops
               if not op.inside and op.kind in ("rename", "link", "copy") and not op.error and op.effect]
    while True:
        more = {origin for origin, to in outside if origin.startswith("/") and any(_under(to, f) for f in out)} - out
        if not more:
            return out
        out |= more


def with_sources(ops: list[Op], root: Path) -> list[Op]:
    """`ops`, each copy, link or rename that brings in a file from outside what the trace wrote
    before it carrying that file's record (SourceFile: its bytes are read back from disk, and must
    not have changed), taken now: right after the run. A source the trace wrote takes its bytes
    from the trace, and is none of these."""
    out, seen, put = list(ops), {}, set()
    for i, op in enumerate(ops):
        path = _brought_from(op)
        if path is not None and not any(p in put for p in _and_above(path)):
            at, problem = _at_the_end(ops, i, op.target if op.kind == "rename" else path, path)
            at = at if at.startswith("/") else os.path.join(root, at)
            if (path, at, problem) not in seen:
                seen[(path, at, problem)] = SourceFile(path, at, problem=problem) if problem else record_source(path, at)
            out[i] = dataclasses.replace(op, source=seen[(path, at, problem)])
        if _puts(op) is not None:
            put.add(_puts(op))
    return out


def _and_above(path: str):
    """`path` and each directory above it."""
    while path not in ("", "/"):
        yield path
        path = os.path.dirname(path)


def _at_the_end(ops: list[Op], i: int, where: str, path: str) -> tuple[str, str]:
    """Where the bytes that op `i` brought in from `path` (at `where` just after it) lay when the run
    ended, and "" or why they were no longer there: the run moved the file on (a rename), or changed,
    replaced or deleted it."""
    for op in ops[i + 1:]:
        if op.error or not op.effect:
            continue
        if op.kind == "rename" and _under(where, op.path):
            where = op.target + where[len(op.path):]
        elif (op.kind in ("write", "truncate", "copy") and op.path == where) or (
                op.kind in ("create", "open") and op.path == where and "O_TRUNC" in op.flags):
            return where, (f"the run changed `{where}` after op #{ops[i].index} brought in `{path}`: its bytes then "
                           "are lost")
        elif (op.kind in ("rename", "link") and _under(where, op.target)) or (
                op.kind == "unlink" and op.path == where):
            return where, (f"the run replaced or deleted `{where}` after op #{ops[i].index} brought in `{path}`: its "
                           "bytes are lost")
    return where, ""
