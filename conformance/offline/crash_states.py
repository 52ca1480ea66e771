"""Crash states without re-training: the checkpoint directory a kill before each recorded
operation leaves, rebuilt offline from one recording.

A process kill never loses the page cache, so the state a kill leaves before operation i is
exactly operations 0..i-1 applied in order. A kill that lands *during* a large write can leave
part of it (the kernel checks for fatal signals between pages), so every write of more than one
byte also gets a "torn" variant with its first half applied. Building a state costs
milliseconds; checks/states.py decides each one with a short resume.

It is also the one owner of which files belong to a checkpoint (`save_paths`, `save_files`):
retention (retained.py), power cuts, corruption_detected and the newest checkpoint's files
(checks/common.py) ask it, for a run recorded with data or, with `with_stand_in_bytes`, one
recorded for paths only.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from ..model.process import RunSpec
from ..trace import strace
from ..trace.operations import MUTATIONS
from ..trace.recording import Op, RecordedRun, UnreplayableTrace, outside_bytes
from .unseen import DirectoryView


class Replayer:
    """Applies recorded operations to an in-memory model of the checkpoint directory."""

    def __init__(self):
        self.files: dict[str, bytearray] = {}
        self.dirs: set[str] = {"."}
        self.symlinks: dict[str, str] = {}
        self.positions: dict[tuple[int, int, str], int] = {}   # (rank, fd, path) -> offset
        # path -> the generation of its bytes: a new number whenever they change, carried by a
        # rename. Two states whose files have the same generations hold the same bytes.
        self.gens: dict[str, int] = {}
        self._next_gen = 0
        # path -> why its bytes cannot be had (the trace cut them short, a source outside it
        # changed): `files` holds stand-in bytes, unique to the operation, and a state that shows
        # such a file cannot be rebuilt (problem()), though it can be compared with others.
        self.unknown: dict[str, str] = {}

    def _changed(self, path: str) -> None:
        self._next_gen += 1
        self.gens[path] = self._next_gen

    def view(self) -> DirectoryView:
        """What the state shows inside the checkpoint directory (unseen.py), files by generation;
        its `key`: equal keys, equal directories. An fsync changes nothing a kill leaves, so the
        states before and after it share a key."""
        return DirectoryView.of({p: self.gens.get(p, 0) for p in self.files}, self.dirs, self.symlinks)

    def apply(self, op: Op, *, torn: bool = False) -> None:
        if op.error or not op.effect:
            return   # an injected failure changed nothing; nor did a mkdir of an existing directory
        k = op.kind
        if k == "mkdir":
            self.dirs.add(op.path)
        elif k in ("create", "open"):
            if "O_TRUNC" in op.flags or op.path not in self.files:
                self.files[op.path] = bytearray()
                self.unknown.pop(op.path, None)
                self._changed(op.path)
            self.positions[(op.rank, op.fd, op.path)] = len(self.files[op.path]) if "O_APPEND" in op.flags else 0
        elif k == "write":
            data, why = op.data, ""
            if data is None:
                data, why = stand_in(op), cut_short(op)
            self._put(op, data[: torn_length(data)] if torn else data, op.offset, why)
        elif k == "copy":   # sendfile/copy_file_range: the source's bytes, at the destination's position
            source, why = self._from(op, op.target) if op.offset is not None else (b"", no_offset(op))
            data = bytes(source[op.offset:op.offset + op.length]) if not why else stand_in(op, op.length)
            self._put(op, data[: torn_length(data)] if torn else data, None, why if data else "")
        elif k == "seek":
            self.positions[(op.rank, op.fd, op.path)] = op.offset
        elif k == "truncate":
            buf = self.files.setdefault(op.path, bytearray())
            del buf[op.offset:]
            buf.extend(b"\0" * (op.offset - len(buf)))
            if not op.offset:
                self.unknown.pop(op.path, None)
            self._changed(op.path)
        elif k == "rename":
            if op.source is not None:
                self._bring(op)
            else:
                self._move(op.path, op.target)
        elif k == "link":
            if op.source is not None or op.path not in self.files:
                self._bring(op)
            else:
                self.files[op.target] = bytearray(self.files[op.path])
                self.gens[op.target] = self.gens.get(op.path, 0)
                self._known(op.target, self.unknown.get(op.path, ""))
        elif k == "symlink":
            self.symlinks[op.path] = op.target
        elif k == "unlink":
            for table in (self.files, self.gens, self.symlinks, self.unknown):
                table.pop(op.path, None)
        elif k == "rmdir":
            self.dirs.discard(op.path)
            self.unknown.pop(op.path, None)
            # unlinkat(AT_REMOVEDIR) only succeeds on an empty directory, so nothing else goes

    def _put(self, op: Op, data: bytes, offset: int | None, why: str) -> None:
        """`data` written into op's file at `offset` (None: at the fd's position, which moves on)."""
        buf = self.files.setdefault(op.path, bytearray())
        pos = offset if offset is not None else self.positions.get((op.rank, op.fd, op.path), len(buf))
        if pos > len(buf):
            buf.extend(b"\0" * (pos - len(buf)))
        buf[pos:pos + len(data)] = data
        self._changed(op.path)
        if why:
            self.unknown[op.path] = why
        if offset is None:
            self.positions[(op.rank, op.fd, op.path)] = pos + len(data)

    def _known(self, path: str, why: str) -> None:
        if why:
            self.unknown[path] = why
        else:
            self.unknown.pop(path, None)

    def _from(self, op: Op, path: str) -> tuple[bytes | bytearray, str]:
        """The bytes of `path`, which `op` copies, links or renames, and "" or why they cannot be had:
        a file from outside what the trace wrote is read back from disk (recording.SourceFile), one
        the trace wrote was replayed here."""
        outside = outside_bytes(op)
        if outside is not None:
            return outside
        if path in self.files:
            return self.files[path], self.unknown.get(path, "")
        return b"", f"op #{op.index} ({op.describe()}): the source's bytes are not in the recording"

    def _bring(self, op: Op) -> None:
        """A link or rename that brings in a file (or a directory) from outside what the trace wrote."""
        if op.source is not None and op.source.directory:
            self.dirs.add(op.target)
            self.unknown[op.target] = f"op #{op.index} ({op.describe()}): {op.source.problem}"
            return
        data, why = self._from(op, op.path)
        self.files[op.target] = bytearray(data if not why else stand_in(op))
        self._changed(op.target)
        self._known(op.target, why)

    def problem(self) -> str:
        """Why the directory as it stands now cannot be rebuilt ("" when it can): a file or directory in
        it whose bytes are unknown."""
        return next((f"`{p}` cannot be rebuilt: {why}" for p, why in sorted(self.unknown.items())
                     if not p.startswith("/")), "")

    def _move(self, src: str, dst: str) -> None:
        def moved(p: str) -> str | None:
            return moved_by_rename(p, src, dst)
        for table in (self.files, self.gens, self.symlinks, self.unknown):
            for p in [p for p in table if moved(p)]:
                table[moved(p)] = table.pop(p)
        for p in [p for p in self.dirs if moved(p)]:
            self.dirs.discard(p)
            self.dirs.add(moved(p))
        # os.replace onto an existing directory needs it empty; onto a file it replaces it

    def materialize(self, directory: Path) -> None:
        """Write the directory out; UnreplayableTrace (why) when it cannot be rebuilt."""
        why = self.problem()
        if why:
            raise UnreplayableTrace(why)
        directory.mkdir(parents=True, exist_ok=True)
        for d in sorted(self.dirs, key=len):
            if not d.startswith("/"):
                (directory / d).mkdir(parents=True, exist_ok=True)
        for p, data in self.files.items():
            if p.startswith("/"):
                continue   # a file outside the checkpoint directory (not renamed in yet)
            target = directory / p
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(bytes(data))
        for p, t in self.symlinks.items():
            (directory / p).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(t, directory / p)


@dataclasses.dataclass(frozen=True)
class CrashState:
    """The directory a kill before `ops[before]` leaves (torn: with half of that write applied)."""

    before: int
    torn: bool
    description: str
    newest_committed: int
    in_progress: int | None
    save_complete: bool = False   # the interrupted save's files already hold their final bytes
    content: str = ""             # the key of the directory it leaves (Replayer.view; "" unknown)
    view: DirectoryView | None = dataclasses.field(default=None, compare=False, repr=False)
    left_out: str = ""            # why this state cannot be rebuilt ("" when it can): it is not decided

    @property
    def verdict_key(self) -> tuple:
        """What its verdict depends on: the directory, and what the judge and the probes are told.
        States with equal keys are decided once (see distinct)."""
        return (self.content or self.label, self.newest_committed, self.in_progress, self.save_complete)

    @property
    def label(self) -> str:
        return f"{self.before}{'t' if self.torn else ''}"


def stand_in(op: Op, length: int | None = None) -> bytes:
    """Bytes that stand for ones the replayer cannot have (`length` of them, or a short mark), unique
    to the operation: a file holds them again only where nothing changed it since."""
    mark = b"\0stand-in for op #%d\0" % op.index
    return mark if length is None else (mark * (length // len(mark) + 1))[:length]


def cut_short(op: Op) -> str:
    return (f"op #{op.index} ({op.describe()}): the recording cut its bytes short (writes larger than "
            f"{strace.MAX_DATA_BYTES} bytes cannot be replayed)")


def no_offset(op: Op) -> str:
    return f"op #{op.index} ({op.describe()}): the offset it read its source at is not in the recording"


def torn_length(data: bytes) -> int:
    """How much of a write a kill landing during it leaves in a torn state: the first half."""
    return max(1, len(data) // 2)


def crash_states(run: RecordedRun) -> list[CrashState]:
    """Every crash state of the recorded run, in order: before each mutation under the checkpoint
    directory, and during each write of more than one byte. A state that shows a file whose bytes
    the replayer cannot have (Replayer.problem) says why in `left_out`. UnreplayableTrace when the
    run did something the replayer cannot model at all (run.unreplayable): no state is known."""
    if run.unreplayable:
        raise UnreplayableTrace(run.unreplayable)
    complete = _save_complete_before(run)
    wanted = set(run.mutations)
    replayer = Replayer()
    states = []
    for op in run.ops:
        i = op.index
        if i in wanted:
            newest, in_progress = run.settled_before(i), run.in_progress(i)
            where = f"{run.role(i)}: {op.describe()}"
            view = replayer.view()
            key = view.key
            why = replayer.problem()
            states.append(CrashState(i, False, f"kill before op #{i} ({where})", newest, in_progress, complete[i], key,
                                     view, why))
            if op.kind == "write" and (len(op.data) > 1 if op.data is not None else not op.path.startswith("/")):
                # Half of a write to a file not yet renamed in shows nothing new.
                torn = key if op.path.startswith("/") else f"{key}+torn{i}"
                part = f"only the first {torn_length(op.data)} bytes" if op.data is not None else "only part of it"
                states.append(CrashState(i, True, f"kill during op #{i} ({where}), {part} written", newest, in_progress,
                                         complete[i], torn, view.but(op.path, f"torn{i}"),
                                         why or (cut_short(op) if op.data is None else "")))
        replayer.apply(op)
    return states


def distinct(states: list, key=lambda s: s.verdict_key) -> dict:
    """States grouped by what decides their verdict, in order: the first of each group stands
    for the others (a state's verdict is a function of its directory and its judging alone)."""
    groups: dict = {}
    for state in states:
        groups.setdefault(key(state), []).append(state)
    return {group[0]: group[1:] for group in groups.values()}


def same_directory_note(alike: list, what: str) -> str:
    """For a failure message: which other states (`what` names them, e.g. "states") leave the
    directory the failing one left, or one its resume could not tell from it (unseen.py), and so
    share its verdict; "" when none do."""
    if not alike:
        return ""
    alike = sorted(alike, key=lambda s: (s.before, getattr(s, "torn", False)))
    more = " ..." if len(alike) > 6 else ""
    return (f" ({what} {', '.join(s.label for s in alike[:6])}{more} leave the same directory, or one that "
            "differs only in files the resume never looked at)")


# What a save puts bytes or a name at (`save_paths`): every change but a removal or a sync.
_PUTS = MUTATIONS - {"unlink", "rmdir", "fsync"}


def save_paths(run: RecordedRun) -> dict[int, tuple[str, ...]]:
    """Step s -> every path its save put bytes or a name at, in the order it first did: what it
    made, wrote, copied to or truncated, a rename's or a link's target and a symlink's own name
    (never what it only read: a copy's or a link's source, a symlink's target), and for a renamed
    directory the paths it had put under it, at their new place (just after the old one)."""
    out: dict[int, dict[str, None]] = {}
    for op in run.ops:
        dst = op.target if op.kind in ("rename", "link") else op.path
        if not op.save or op.kind not in _PUTS or not dst:
            continue
        paths = out.setdefault(op.save, {})
        if op.kind == "rename":
            paths = out[op.save] = {q: None for p in paths for q in (p, moved_by_rename(p, op.path, dst)) if q}
        paths[dst] = None
    return {s: tuple(paths) for s, paths in out.items()}


def moved_by_rename(path: str, src: str, dst: str) -> str | None:
    """Where a rename of `src` to `dst` takes `path` (None: it is not `src` or under it): the one
    rule, which the replayer here and the power-loss model (powerloss.py) apply too."""
    return dst + path[len(src):] if path == src or path.startswith(src + "/") else None


def _at_or_under(path: str, tops: set[str] | frozenset[str]) -> bool:
    """Whether `path` (relative) is one of `tops` or lies under one: its ancestors, looked up."""
    while path not in tops:
        path, sep, _ = path.rpartition("/")
        if not sep:
            return False
    return True


def save_files(run: RecordedRun) -> dict[int, dict[str, bytes]]:
    """Step s -> the files its save leaves behind, with their bytes: those present when its last
    operation is over that lie at or under a path it put bytes or a name at (save_paths: a
    directory it made or renamed in holds its files): what a complete checkpoint of step s is. A
    directory the save only fsynced is not its (a node's directory holds every save's checkpoints)."""
    ends = {idxs[-1]: s for s, idxs in run.windows().items() if s}
    paths = save_paths(run)
    finals: dict[int, dict[str, bytes]] = {}
    replayer = Replayer()
    for op in run.ops:
        replayer.apply(op)
        if op.index in ends:
            s = ends[op.index]
            put = set(paths.get(s, ()))
            finals[s] = {p: bytes(b) for p, b in replayer.files.items() if not p.startswith("/")
                         and _at_or_under(p, put)}
    return finals


def with_stand_in_bytes(run: RecordedRun) -> RecordedRun:
    """`run`, replayable though recorded for paths only: a write whose bytes the trace cut short
    (and a copy, whose bytes come from elsewhere) is a write of stand-in bytes of its own, unique
    to the operation, so a file ends holding its save's bytes exactly when nothing after the save
    changed it."""
    return dataclasses.replace(run, ops=tuple(_with_stand_in_bytes(op) for op in run.ops))


def _with_stand_in_bytes(op: Op) -> Op:
    if op.kind == "copy" or (op.kind == "write" and op.data is None):
        return dataclasses.replace(op, kind="write", data=stand_in(op), offset=op.offset if op.kind == "write" else None,
                                   target="", length=0, source=None)
    return op


def _save_complete_before(run: RecordedRun) -> dict[int, bool]:
    """Op index -> whether, just before it, every file its save leaves behind already holds its
    final bytes (later operations of the save only sync or clean up). Decides only which probe
    runs first; the verdict does not depend on it."""
    finals = save_files(run)
    out: dict[int, bool] = {}
    replayer = Replayer()
    for op in run.ops:
        s = run.in_progress(op.index) or 0 if op.mutation else op.save
        final = finals.get(s)
        out[op.index] = bool(s and final) and all(replayer.files.get(p) == b for p, b in final.items())
        replayer.apply(op)
    return out


def build_state(run: RecordedRun, state: CrashState, directory: Path) -> None:
    """Write the directory `state` leaves; UnreplayableTrace (why) when it cannot be rebuilt, now
    (a source outside the trace changed since the run was recorded) or ever."""
    if run.unreplayable:
        raise UnreplayableTrace(run.unreplayable)
    replayer = Replayer()
    for op in run.ops[: state.before]:
        replayer.apply(op)
    if state.torn:
        replayer.apply(run.ops[state.before], torn=True)
    if directory.exists():
        shutil.rmtree(directory)
    replayer.materialize(directory)


def probe_specs(spec: RunSpec, state: CrashState) -> list[RunSpec]:
    """Runs that check a state, in order; the next runs only if the trainer exited 0 without
    training (it resumed past the probe's end). One step past the checkpoint the trainer should
    resume from: the interrupted save's if its files are already final, else the newest committed
    one (and then the interrupted save's, if the trainer took that as complete)."""
    older = spec.but(total_steps=min(spec.total_steps, state.newest_committed + 1))
    if not state.in_progress or state.in_progress + 1 <= older.total_steps:
        return [older]
    newer = spec.but(total_steps=min(spec.total_steps, state.in_progress + 1))
    return [newer] if state.save_complete else [older, newer]
