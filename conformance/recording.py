"""The model of what one traced run did: the one owner of "which operations, in which save, and
which saves were committed before operation i".

A `RecordedRun` is built from the syscalls `strace.parse` returns: every filesystem operation under
the checkpoint directory in order (with its bytes, when the run was recorded with data), files
written elsewhere and later renamed in, the loss-log writes that mark step boundaries, and the
files a run opened for reading. Scenarios, crash states, strategies and the checks ask it; none
of them reads a trace or recomputes these facts.

A save is a logical unit learned from the run (saves.py; in flight across steps too), committed
before operation i when all of its operations come before i.

A multi-rank job is recorded rank by rank (each rank's own trace, its own steps) and merged into
one run in the order the operations happened (strace's -ttt entry times, one clock for all
ranks): a save is then every rank's operations for that step, committed before operation i when
every rank's part comes before i. Each rank's own run stays available (`rank_view`): kills and
injections are planned on it, and two runs are aligned rank by rank.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path

from . import strace
from .process import ProcessResult, RunSpec, rank_log
from .saves import attribute_saves, surely_committed_by

# Operations that change the directory or a file's bytes (crash points are drawn among these).
MUTATIONS = frozenset({"mkdir", "create", "write", "copy", "truncate", "rename", "unlink", "rmdir", "link",
                       "symlink", "fsync"})
_WRITE_CALLS = ("write", "pwrite64", "writev", "pwritev", "pwritev2")
_OPEN_WRITE_FLAGS = ("O_CREAT", "O_TRUNC", "O_WRONLY", "O_RDWR", "O_APPEND")


class UnreplayableTrace(Exception):
    """The recorded run did something the offline replayer cannot rebuild exactly (named)."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One recorded filesystem operation (paths relative to the checkpoint directory; absolute for
    a file written elsewhere and later renamed in)."""

    index: int
    kind: str                  # mkdir create open write copy seek truncate rename unlink rmdir link symlink fsync
    path: str
    target: str = ""           # rename/link destination, symlink target; a copy's source file
    data: bytes | None = b""   # bytes written; None if the trace cut them short
    offset: int | None = None  # pwrite/seek/truncate offset (a copy's source offset); None: at the fd's position
    length: int = 0            # bytes a copy moved
    fd: int = -1
    flags: str = ""
    after_step: int = 0        # the last step logged before this operation (0: none yet)
    inside: bool = True        # False: a file elsewhere, kept because it is renamed in later
    syscall: str = ""
    nth: int = 0
    tid: int = 0
    targetable: bool = False   # a KILL injected at (syscall, nth) lands here and nowhere earlier
    killed: bool = False       # the process died inside this call
    error: str = ""            # an errno the suite injected: the call failed and changed nothing
    rank: int = 0              # the rank that made it (0 for a single process)
    ts: float = 0.0            # when it was entered (seconds since the epoch; 0 if not recorded)
    local: int = -1            # its index in its rank's own run (jobs; -1 for a single process)
    effect: bool = True        # False: a mkdir that found the directory there (another rank made it)
    signalled: bool = False    # the suite injected a signal (SIGTERM) at this call
    save: int = 0              # the step of the save it belongs to (0: none; see attribute_saves)
    lane: int = 0              # its thread within that save: 0 the logging thread, 1.. other threads

    @property
    def mutation(self) -> bool:
        return self.inside and self.kind in MUTATIONS

    def describe(self) -> str:
        if self.kind == "write":
            size = "?" if self.data is None else len(self.data)
            return f"write {size} bytes to {self.path}"
        if self.kind == "copy":
            return f"copy {self.length} bytes from {self.target} to {self.path}"
        if self.kind in ("rename", "link"):
            return f"{self.kind} {self.path} -> {self.target}"
        if self.kind == "fsync" and self.syscall == "fdatasync":
            return f"fdatasync {self.path}"
        return f"{self.kind} {self.path}"


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
        """The save op `op_index` belongs to, or None outside any save."""
        return self.ops[op_index].save or None

    def position_in_save(self, op_index: int) -> int:
        """1-based position of op `op_index` among its save's mutations on its thread (its rank's,
        in a job): the same in every run, however threads interleave."""
        me = self.ops[op_index]
        same = [i for i in self.windows().get(me.save, []) if self.ops[i].rank == me.rank and self.ops[i].lane == me.lane]
        return same.index(op_index) + 1

    def role(self, op_index: int) -> str:
        """What an operation is, independent of run-random names and of how threads interleave:
        its place in its save, on its thread."""
        op, s = self.ops[op_index], self.ops[op_index].save
        where = f"the save of step {s}" if s else "the start of the run"
        who = f"rank {op.rank}'s " if self.ranks else ""
        thread = f" (background thread {op.lane})" if op.lane else ""
        return f"{who}{op.kind} #{self.position_in_save(op_index)} of {where}{thread}"

    def committed_at(self, ts: float) -> int:
        """The newest save all of whose operations (every rank's) were entered before time `ts`."""
        return max((s for s, idxs in self.windows().items() if s and self.ops[idxs[-1]].ts < ts), default=0)

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
    root_s, log_s = str(ckpt_dir), str(loss_log)
    first_to_reach: dict[tuple[str, int], int] = {}
    reached_by: dict[tuple[str, int], set[int]] = {}
    for sc in syscalls:
        first_to_reach.setdefault((sc.name, sc.nth), sc.seq)
        reached_by.setdefault((sc.name, sc.nth), set()).add(sc.tid)
    ops: list[Op] = []
    step_logs: dict[int, strace.Syscall] = {}
    reads: set[str] = set()
    unreplayable: list[str] = []
    mapped: set[str] = set()
    logged = 0
    ordered_steps = iter(sorted(result.losses))

    def rel(path: str | None) -> str | None:
        """Relative to the root for paths under it; absolute for other regular paths (a file
        written elsewhere and renamed in keeps its bytes); None for the rest."""
        if path is None:
            return None
        if path == root_s:
            return "."
        if path.startswith(root_s + os.sep):
            return path[len(root_s) + 1:]
        if path.startswith("/") and path != log_s and (
                path.startswith("/dev/shm/") or not path.startswith(("/dev/", "/proc/", "/sys/"))):
            return path
        return None

    def add(sc: strace.Syscall, kind: str, path: str, **kw) -> None:
        # A rename or link is inside if either end is; a copy (`target`: its source) if its path is.
        inside = not path.startswith("/") or (kind in ("rename", "link") and not kw.get("target", "/").startswith("/"))
        targetable = kind != "create" and first_to_reach.get((sc.name, sc.nth)) == sc.seq
        ops.append(Op(len(ops), kind, path, after_step=logged, inside=inside, syscall=sc.name, nth=sc.nth,
                      tid=sc.tid, targetable=targetable, killed=sc.killed, error=sc.injected_error or "",
                      rank=rank or 0, ts=sc.ts, signalled=bool(sc.signalled), **kw))

    for sc in syscalls:
        if sc.failed and not sc.injected_error:
            if rank is not None and sc.name in ("mkdir", "mkdirat") and (sc.ret or "").startswith("-1 EEXIST"):
                # In a job every rank may create the same directory (DCP's writers do): which one
                # gets EEXIST is a race, so each rank's call counts as its operation, with no effect.
                path = rel(strace.resolve(sc.args[0], sc.args[1]) if sc.name == "mkdirat"
                           else strace.resolve(None, sc.args[0]))
                if path is not None and path != ".":
                    add(sc, "mkdir", path, effect=False)
            continue   # a failed call changes nothing (an injected failure is kept, marked, for landing)
        call, args = sc.name, sc.args
        if call in _WRITE_CALLS:
            if not args:
                continue
            if strace.fd_path(args[0]) == log_s:
                if (sc.signalled or sc.injected_error) and not sc.killed:
                    # Where an injected signal or error hit (a fault meant for another call): kept
                    # to tell how far off the count was. A signalled write still logged its step.
                    ops.append(Op(len(ops), "log", log_s, after_step=logged, inside=False, syscall=call,
                                  nth=sc.nth, tid=sc.tid, signalled=bool(sc.signalled),
                                  error=sc.injected_error or "", rank=rank or 0, ts=sc.ts,
                                  targetable=first_to_reach.get((sc.name, sc.nth)) == sc.seq))
                if not sc.killed and not sc.injected_error:
                    logged = _logged_step(sc, logged, ordered_steps)
                    step_logs[logged] = sc
                else:   # killed about to log step k: at step k - 1 (a resumed process is not at 0)
                    ops.append(Op(len(ops), "log", log_s, after_step=max(logged, _logged_step(sc, logged, iter(())) - 1),
                                  inside=False, syscall=call, nth=sc.nth, tid=sc.tid, killed=True, rank=rank or 0,
                                  ts=sc.ts, targetable=first_to_reach.get((sc.name, sc.nth)) == sc.seq))
                continue
            path = rel(strace.fd_path(args[0]))
            if path is None:
                continue
            add(sc, "write", path, data=strace.written_bytes(sc), fd=strace.fd_number(args[0]),
                offset=int(args[3]) if call in ("pwrite64", "pwritev", "pwritev2") and len(args) > 3 else None)
        elif call in ("sendfile", "copy_file_range", "splice"):
            out_arg, in_arg, off_arg = ((args[0], args[1], args[2]) if call == "sendfile" else
                                        (args[2], args[0], args[1]) if call == "copy_file_range" else
                                        (args[2], args[0], args[1]))
            path = rel(strace.fd_path(out_arg))
            if path is None:
                continue
            source = rel(strace.fd_path(in_arg))
            m = re.match(r"^\[(\d+)\]", off_arg.strip())
            explicit_out = call != "sendfile" and len(args) > 3 and "NULL" not in args[3]
            if source is None or m is None or call == "splice" or explicit_out:
                unreplayable.append(f"{call} into {path} (its bytes come from {strace.fd_path(in_arg)}, not in the trace)")
            add(sc, "copy", path, target=source or "", offset=int(m.group(1)) if m else None,
                length=sc.value or 0, fd=strace.fd_number(out_arg), data=None)
        elif call == "fallocate":
            path = rel(strace.fd_path(args[0]))
            if path is not None:
                unreplayable.append(f"fallocate on {path}")
                add(sc, "write", path, data=None, fd=strace.fd_number(args[0]))
        elif call in ("openat", "open", "creat"):
            dir_arg, path_arg = (args[0], args[1]) if call == "openat" else (None, args[0] if args else "")
            path = rel(strace.resolve(dir_arg, path_arg))
            flags = (args[2] if call == "openat" and len(args) > 2 else args[1] if call == "open" and len(args) > 1
                     else "O_CREAT|O_TRUNC|O_WRONLY")
            if path is None:
                continue
            if not any(f in flags for f in _OPEN_WRITE_FLAGS):
                if not path.startswith("/") and not sc.killed:
                    reads.add(path)
                continue
            if "O_DIRECT" in flags:
                unreplayable.append(f"O_DIRECT writes to {path}")
            kind = "create" if ("O_CREAT" in flags or "O_TRUNC" in flags) else "open"
            add(sc, kind, path, fd=sc.value if sc.value is not None else -1, flags=flags)
        elif call == "lseek":
            path = rel(strace.fd_path(args[0]))
            if path is not None and sc.value is not None:
                add(sc, "seek", path, fd=strace.fd_number(args[0]), offset=sc.value)
        elif call in ("ftruncate", "truncate"):
            path = rel(strace.fd_path(args[0]) if call == "ftruncate" else strace.resolve(None, args[0]))
            if path is not None:
                add(sc, "truncate", path, fd=strace.fd_number(args[0]) if call == "ftruncate" else -1,
                    offset=int(args[1]))
        elif call in ("rename", "renameat", "renameat2", "link", "linkat"):
            if call in ("rename", "link"):
                src, dst = strace.resolve(None, args[0]), strace.resolve(None, args[1])
            else:
                src, dst = strace.resolve(args[0], args[1]), strace.resolve(args[2], args[3])
            s, d = rel(src), rel(dst)
            if s is None or d is None:
                if (s or "/").startswith("/") and (d or "/").startswith("/"):
                    continue   # nothing under the checkpoint directory
                unreplayable.append(f"{call} from or to a path that is not a regular file: {src} -> {dst}")
                continue
            add(sc, "rename" if call.startswith("rename") else "link", s, target=d)
        elif call in ("unlink", "unlinkat", "rmdir"):
            path = rel(strace.resolve(args[0], args[1]) if call == "unlinkat" else strace.resolve(None, args[0]))
            if path is not None:
                is_dir = call == "rmdir" or (call == "unlinkat" and len(args) > 2 and "AT_REMOVEDIR" in args[2])
                add(sc, "rmdir" if is_dir else "unlink", path)
        elif call in ("mkdir", "mkdirat"):
            path = rel(strace.resolve(args[0], args[1]) if call == "mkdirat" else strace.resolve(None, args[0]))
            if path is not None and path != ".":
                add(sc, "mkdir", path)
        elif call in ("symlink", "symlinkat"):
            link = rel(strace.resolve(args[1], args[2]) if call == "symlinkat" else strace.resolve(None, args[1]))
            if link is not None:
                add(sc, "symlink", link, target=strace.string_path(args[0]) or "")
        elif call in ("fsync", "fdatasync"):
            path = rel(strace.fd_path(args[0]))
            if path is not None:
                add(sc, "fsync", path, fd=strace.fd_number(args[0]))
        elif call == "mmap" and len(args) > 4 and "PROT_WRITE" in args[2] and "MAP_SHARED" in args[3]:
            path = rel(strace.fd_path(args[4]))
            if path is not None:
                mapped.add(path)   # matters only for a file under the root, or one renamed into it
    # Operations elsewhere matter only for files that end up under the root: drop the rest.
    feeding = {op.path for op in ops if op.kind in ("rename", "link") and op.inside and op.path.startswith("/")}
    unreplayable += [f"a shared writable mmap of {p} (its writes are not syscalls)" for p in sorted(mapped)
                     if not p.startswith("/") or p in feeding]
    kept = [op for op in ops if op.inside or op.kind == "log"
            or any(op.path == f or op.path.startswith(f + "/") for f in feeding)]
    kept = [dataclasses.replace(op, index=i, local=i if rank is not None else -1) for i, op in enumerate(kept)]
    logging_tids = {sc.tid for sc in step_logs.values()}
    main_tid = min(logging_tids) if logging_tids else (syscalls[0].tid if syscalls else 0)
    kept = attribute_saves(kept, main_tid, spec.save_every)
    run = RecordedRun(spec, result, Path(ckpt_dir), tuple(kept), step_logs, frozenset(reads), preexisting,
                      "; ".join(dict.fromkeys(unreplayable)) or None,
                      shared_counts=frozenset(k for k, tids in reached_by.items() if len(tids) > 1))
    return run


def _logged_step(sc: strace.Syscall, previous: int, ordered_steps) -> int:
    """The step a loss-log write logged: read from its JSON line, else the next logged step."""
    try:
        text = strace.decode_string(sc.args[1]).decode("utf-8", "replace")
        steps = [int(json.loads(line)["step"]) for line in text.splitlines() if line.strip()]
        if steps:
            return max(steps)
    except (ValueError, KeyError, TypeError, IndexError):
        pass
    return next(ordered_steps, previous + 1)
