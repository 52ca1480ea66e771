"""Power-loss states: the checkpoint directory a power cut (or the loss of a node) before each
recorded operation leaves, rebuilt offline from the baseline's recording.

Unlike a process kill, a power cut loses the page cache. Two persistence models:

- `data` (LazyFS's "clear-cache"): directory-entry and size operations (create, mkdir, rename,
  unlink, rmdir, truncate, link) persist in program order; each file's bytes are what they were at
  its last fsync/fdatasync, and a file never synced is empty (ext4's zero-length file after a
  rename without fsync).
- `strict` (the conservative POSIX model of ALICE and CrashMonkey): as `data`, but a
  directory-entry operation persists only if its parent directory was fsynced after it (both
  parents for a rename). Otherwise it is rolled back: a new name vanishes, a rename reverts, an
  unlink restores the old name with its synced bytes.

Files are tracked as inodes, so a rename carries its synced bytes, an unlinked file keeps them,
and an fsync through any name makes them durable.
"""
from __future__ import annotations

import dataclasses
import os
import posixpath
import shutil
from pathlib import Path

from ..trace.recording import Op, RecordedRun, UnreplayableTrace, outside_bytes
from .crash_states import cut_short, moved_by_rename, no_offset, stand_in
from .unseen import DirectoryView, bytes_identity

MODELS = ("data", "strict")


@dataclasses.dataclass
class Inode:
    data: bytearray = dataclasses.field(default_factory=bytearray)
    synced: bytes | None = None          # bytes made durable by the last fsync (None: never synced)
    sizes: list[int] = dataclasses.field(default_factory=list)   # truncates since that fsync
    unknown: str = ""                    # why its bytes cannot be had (they are stand-ins), "" if they can
    synced_unknown: str = ""             # the same, of the bytes its last fsync made durable

    def durable_unknown(self) -> str:
        return "" if 0 in self.sizes else self.synced_unknown

    def durable(self) -> bytes:
        out = bytearray(self.synced or b"")
        for size in self.sizes:
            del out[size:]
            out.extend(b"\0" * (size - len(out)))
        return bytes(out)


@dataclasses.dataclass(frozen=True)
class EntryOp:
    """A directory-entry operation, with the directories whose fsync makes it durable."""

    index: int
    kind: str            # create, mkdir, rename, unlink, rmdir, link, symlink
    path: str
    target: str
    inode: int | None
    parents: frozenset[str]


def _parent(path: str) -> str:
    return posixpath.dirname(path) or "."


@dataclasses.dataclass
class Cut:
    """What a power cut before an operation leaves: files (path -> bytes), directories, symlinks,
    and what was lost, for messages."""

    files: dict[str, bytes]
    dirs: set[str]
    symlinks: dict[str, str]
    lost_data: dict[str, str]      # path -> why its bytes are not what the run last wrote
    lost_entries: dict[str, str]   # path -> which directory-entry operation did not persist
    left_out: str = ""             # why this state cannot be rebuilt ("" when it can)

    def view(self) -> DirectoryView:
        """What this cut's directory holds (unseen.py); its `key`: equal keys, equal directories."""
        return DirectoryView.of({p: bytes_identity(b) for p, b in self.files.items()}, self.dirs, self.symlinks)

    def materialize(self, directory: Path) -> None:
        """Write the directory out; UnreplayableTrace (why) when it cannot be rebuilt."""
        if self.left_out:
            raise UnreplayableTrace(self.left_out)
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        for d in sorted(self.dirs, key=len):
            (directory / d).mkdir(parents=True, exist_ok=True)
        for p, data in self.files.items():
            (directory / p).parent.mkdir(parents=True, exist_ok=True)
            (directory / p).write_bytes(data)
        for p, t in self.symlinks.items():
            (directory / p).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(t, directory / p)


class Model:
    """Replays operations in order, keeping the page cache (what a kill leaves) and what would
    survive a power cut."""

    def __init__(self):
        self.names: dict[str, int] = {}          # path -> inode (files)
        self.dirs: set[str] = {"."}
        self.symlinks: dict[str, str] = {}
        self.inodes: dict[int, Inode] = {}
        self.positions: dict[tuple[int, int, str], int] = {}   # (rank, fd, path) -> offset
        self.entries: list[EntryOp] = []
        self.dir_syncs: dict[str, list[int]] = {}   # directory -> op indices of its fsyncs
        self.unknown_dirs: dict[str, str] = {}      # a directory brought in from outside the trace -> why

    def _inode(self, path: str, create: bool = True) -> int | None:
        if path not in self.names and create:
            self.names[path] = len(self.inodes)
            self.inodes[self.names[path]] = Inode()
        return self.names.get(path)

    def apply(self, op: Op) -> None:
        if op.error or not op.effect:
            return   # an injected failure changed nothing; nor did a mkdir of an existing directory
        k, i = op.kind, op.index
        if k == "mkdir":
            self.dirs.add(op.path)
            self.entries.append(EntryOp(i, k, op.path, "", None, frozenset({_parent(op.path)})))
        elif k in ("create", "open"):
            new = op.path not in self.names
            node = self.inodes[self._inode(op.path)]
            if "O_TRUNC" in op.flags:
                del node.data[:]
                node.sizes.append(0)
                node.unknown = ""
            if new:
                self.entries.append(EntryOp(i, "create", op.path, "", self.names[op.path],
                                            frozenset({_parent(op.path)})))
            self.positions[(op.rank, op.fd, op.path)] = len(node.data) if "O_APPEND" in op.flags else 0
        elif k == "write":
            data, why = (op.data, "") if op.data is not None else (stand_in(op), cut_short(op))
            self._put(op, data, op.offset, why)
        elif k == "copy":   # sendfile/copy_file_range: the source's (volatile) bytes
            source, why = self._from(op, op.target) if op.offset is not None else (b"", no_offset(op))
            data = bytes(source[op.offset:op.offset + op.length]) if not why else stand_in(op, op.length)
            self._put(op, data, None, why if data else "")
        elif k == "seek":
            self.positions[(op.rank, op.fd, op.path)] = op.offset
        elif k == "truncate":
            node = self.inodes[self._inode(op.path)]
            del node.data[op.offset:]
            node.data.extend(b"\0" * (op.offset - len(node.data)))
            node.sizes.append(op.offset)
            if not op.offset:
                node.unknown = ""
        elif k == "fsync":
            if op.path in self.dirs:
                self.dir_syncs.setdefault(op.path, []).append(i)
            elif op.path in self.names:
                node = self.inodes[self.names[op.path]]
                node.synced, node.sizes, node.synced_unknown = bytes(node.data), [], node.unknown
        elif k in ("rename", "link"):
            src, dst = op.path, op.target
            parents = {_parent(dst)} | ({_parent(src)} if not src.startswith("/") else set())
            if op.source is not None and op.source.directory:
                self.dirs.add(dst)
                self.unknown_dirs[dst] = f"op #{i} ({op.describe()}): {op.source.problem}"
                self.entries.append(EntryOp(i, "mkdir", dst, "", None, frozenset({_parent(dst)})))
                return
            if op.source is not None or (k == "link" and src not in self.names):
                self._bring(op)
            self.entries.append(EntryOp(i, k, src, dst, self.names.get(src), frozenset(parents)))
            if k == "link":
                if src in self.names:
                    self.names[dst] = self.names[src]
            else:
                _move(self.names, self.dirs, self.symlinks, src, dst)
                _move(self.unknown_dirs, set(), {}, src, dst)
        elif k == "symlink":
            self.symlinks[op.path] = op.target
            self.entries.append(EntryOp(i, k, op.path, op.target, None, frozenset({_parent(op.path)})))
        elif k in ("unlink", "rmdir"):
            if k == "unlink":
                self.names.pop(op.path, None)
                self.symlinks.pop(op.path, None)
            else:
                self.dirs.discard(op.path)
            self.entries.append(EntryOp(i, k, op.path, "", None, frozenset({_parent(op.path)})))

    def _put(self, op: Op, data: bytes, offset: int | None, why: str) -> None:
        """`data` written into op's file at `offset` (None: at the fd's position, which moves on)."""
        node = self.inodes[self._inode(op.path)]
        buf = node.data
        pos = offset if offset is not None else self.positions.get((op.rank, op.fd, op.path), len(buf))
        if pos > len(buf):
            buf.extend(b"\0" * (pos - len(buf)))
        buf[pos:pos + len(data)] = data
        if why:
            node.unknown = why
        if offset is None:
            self.positions[(op.rank, op.fd, op.path)] = pos + len(data)

    def _from(self, op: Op, path: str) -> tuple[bytes | bytearray, str]:
        """The bytes of `path`, which `op` copies, links or renames, and "" or why they cannot be had
        (crash_states.Replayer's rule: a source outside what the trace wrote is read back from disk)."""
        outside = outside_bytes(op)
        if outside is not None:
            return outside
        if path in self.names:
            node = self.inodes[self.names[path]]
            return node.data, node.unknown
        return b"", f"op #{op.index} ({op.describe()}): the source's bytes are not in the recording"

    def _bring(self, op: Op) -> None:
        """A file linked or renamed in from outside what the trace wrote: its bytes were on disk,
        durable, before the run; the link or rename that follows names it."""
        data, why = self._from(op, op.path)
        data = bytes(data) if not why else stand_in(op)
        self.names[op.path] = len(self.inodes)
        self.inodes[self.names[op.path]] = Inode(bytearray(data), data, unknown=why, synced_unknown=why)

    def cut(self, model: str, before: int) -> Cut:
        """The state a power cut just before op `before` leaves (ops applied up to it)."""
        if model not in MODELS:
            raise ValueError(f"unknown persistence model {model!r}: {MODELS}")
        if model == "data":
            names, dirs, symlinks, lost_entries = dict(self.names), set(self.dirs), dict(self.symlinks), {}
        else:
            names, dirs, symlinks, lost_entries = self._durable_namespace(before)
        files, lost_data, unknown = {}, {}, {}
        for path, ino in names.items():
            if path.startswith("/"):
                continue
            node = self.inodes[ino]
            files[path] = node.durable()
            if node.durable_unknown():
                unknown[path] = node.durable_unknown()
            if files[path] != bytes(node.data):
                lost_data[path] = ("its data was never fsynced" if node.synced is None else
                                   "it was written after its last fsync")
        dirs = {d for d in dirs if not d.startswith("/") and d != "."}
        unknown.update({d: why for d, why in self.unknown_dirs.items() if d in dirs})
        left_out = next((f"`{p}` cannot be rebuilt: {why}" for p, why in sorted(unknown.items())), "")
        return Cut(files, dirs, {p: t for p, t in symlinks.items() if not p.startswith("/")}, lost_data, lost_entries,
                   left_out)

    def _durable_namespace(self, before: int):
        def durable(entry: EntryOp) -> bool:
            return all(any(entry.index < s < before for s in self.dir_syncs.get(d, ())) for d in entry.parents)
        names: dict[str, int] = {}
        dirs: set[str] = {"."}
        symlinks: dict[str, str] = {}
        lost: dict[str, str] = {}
        for e in self.entries:
            if not durable(e):
                what = {"create": "created", "mkdir": "created", "rename": "renamed into place", "link": "linked",
                        "symlink": "created", "unlink": "deleted", "rmdir": "deleted"}[e.kind]
                where = " and ".join("the checkpoint directory" if d == "." else f"`{d}`" for d in sorted(e.parents))
                lost[e.target or e.path] = (f"`{e.target or e.path}` was {what} but {where} was not fsynced after "
                                            "it, so the change did not persist")
                continue
            if e.kind == "create" and _parent(e.path) in dirs:
                names[e.path] = e.inode
            elif e.kind == "mkdir" and _parent(e.path) in dirs:
                dirs.add(e.path)
            elif e.kind == "rename":
                _move(names, dirs, symlinks, e.path, e.target)
                if e.path.startswith("/") and e.inode is not None:
                    names[e.target] = e.inode   # renamed in from outside the checkpoint directory
            elif e.kind == "link" and e.inode is not None:
                names[e.target] = e.inode
            elif e.kind == "symlink":
                symlinks[e.path] = e.target
            elif e.kind == "unlink":
                names.pop(e.path, None)
                symlinks.pop(e.path, None)
            elif e.kind == "rmdir":
                dirs.discard(e.path)
        # Entries whose directory did not persist are gone with it.
        names = {p: i for p, i in names.items() if p.startswith("/") or _parent(p) in dirs}
        return names, dirs, symlinks, lost


def _move(names: dict, dirs: set, symlinks: dict, src: str, dst: str) -> None:
    def moved(p: str) -> str | None:
        return moved_by_rename(p, src, dst)
    for table in (names, symlinks):
        for p in [p for p in table if moved(p)]:
            table[moved(p)] = table.pop(p)
    for p in [p for p in dirs if moved(p)]:
        dirs.discard(p)
        dirs.add(moved(p))


def cuts(run: RecordedRun, model: str) -> list[tuple[int, Cut]]:
    """(op index, the state a power cut just before it leaves) for every mutation of the run."""
    if run.unreplayable:
        raise UnreplayableTrace(run.unreplayable)
    wanted = set(run.mutations)
    replay = Model()
    out = []
    for op in run.ops:
        if op.index in wanted:
            out.append((op.index, replay.cut(model, op.index)))
        replay.apply(op)
    return out


def cut_before(run: RecordedRun, model: str, before: int) -> Cut:
    if run.unreplayable:
        raise UnreplayableTrace(run.unreplayable)
    replay = Model()
    for op in run.ops[:before]:
        replay.apply(op)
    return replay.cut(model, before)
