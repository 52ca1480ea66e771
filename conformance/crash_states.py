"""Crash states without re-training: record every filesystem operation of one uninterrupted run
(with the bytes it wrote), rebuild offline the checkpoint directory a kill before each operation
leaves, and check there that the trainer resumes from the newest committed checkpoint.

A process kill never loses the page cache, so the state a kill leaves before operation i is
exactly operations 0..i-1 applied in order. A kill that lands *during* a large write can leave
part of it (the kernel checks for fatal signals between pages), so every write of more than one
byte also gets a "torn" variant with its first half applied. Building a state costs
milliseconds; checking it is one short resume (the warm runner forks it): the trainer is started
with total_steps one past the checkpoint it should resume from, so it loads, trains one step,
and the suite compares that loss with the baseline.
"""
from __future__ import annotations

import codecs
import dataclasses
import os
import re
import shutil
from pathlib import Path

from .tracing import _FD_PATH_RE, _LINE_RE, _resolve, _split_args
from .trials import ProcessResult, RunSpec

MAX_WRITE_BYTES = 64 * 1024 * 1024   # strace -s: writes larger than this cannot be replayed
RECORD_SYSCALLS = ("write", "pwrite64", "writev", "pwritev", "openat", "open", "creat", "rename",
                   "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "mkdir", "mkdirat",
                   "fsync", "fdatasync", "ftruncate", "truncate", "lseek", "link", "linkat", "symlink",
                   "symlinkat")
_RESUMED_RE = re.compile(r"^(?P<tid>\d+)\s+<\.\.\. (?P<call>\w+) resumed>(?P<args>.*?)\)\s+=\s+(?P<ret>.*)$")
_RET_RE = re.compile(r"^(?P<val>-?\d+)(?:<(?P<path>[^>]*)>)?")


class UnreplayableTrace(Exception):
    """The recorded run did something the replayer cannot rebuild exactly (named in the message)."""


def record_prefix(trace_file: Path) -> list[str]:
    """strace arguments that record every mutation with its full data (and the loss-log writes)."""
    return ["strace", "-f", "-qq", "-y", "-x", "-s", str(MAX_WRITE_BYTES), "-o", str(trace_file),
            "-e", "trace=" + ",".join(RECORD_SYSCALLS), "--"]


@dataclasses.dataclass(frozen=True)
class Op:
    """One filesystem mutation under the checkpoint directory, replayable offline."""

    index: int
    kind: str                 # mkdir, create, write, truncate, rename, unlink, rmdir, link, symlink, fsync
    path: str                 # relative to the checkpoint directory
    target: str = ""          # rename/link destination, symlink target
    data: bytes = b""
    offset: int | None = None  # None: at the file's current position for this fd
    fd: int = -1
    flags: str = ""
    after_step: int = 0       # the last step logged before this operation
    inside: bool = True       # False: a file elsewhere (paths absolute), e.g. a temp file later renamed in

    def describe(self) -> str:
        if self.kind == "write":
            return f"write {len(self.data)} bytes to {self.path}"
        if self.kind in ("rename", "link"):
            return f"{self.kind} {self.path} -> {self.target}"
        return f"{self.kind} {self.path}"


def _string_arg(arg: str) -> bytes:
    """Decode an strace string argument; raise if strace cut it short."""
    m = re.match(r'^"((?:[^"\\]|\\.)*)"(\.\.\.)?', arg)
    if m is None:
        raise UnreplayableTrace(f"cannot read a data argument: {arg[:80]!r}")
    if m.group(2):
        raise UnreplayableTrace(f"a write larger than {MAX_WRITE_BYTES} bytes cannot be replayed")
    return codecs.escape_decode(m.group(1).encode("latin-1"))[0]


def _joined_lines(text: str):
    """Trace lines with `<unfinished ...>` / `<... resumed>` pairs joined back into one."""
    pending: dict[str, str] = {}
    for line in text.splitlines():
        if line.endswith(" <unfinished ...>"):
            tid = line.split(None, 1)[0]
            pending[tid] = line[: -len(" <unfinished ...>")]
            continue
        m = _RESUMED_RE.match(line)
        if m is not None:
            head = pending.pop(m.group("tid"), None)
            if head is None:
                continue
            line = f"{head}{m.group('args')}) = {m.group('ret')}"
        yield line


def parse_recording(text: str, root: Path, loss_log: Path) -> list[Op]:
    """Mutations under `root`, in order, each tagged with the last step logged before it."""
    root_s, log_s = str(root), str(loss_log)
    ops: list[Op] = []
    logged = 0

    def rel(path: str | None) -> str | None:
        """Path relative to the root for files under it; absolute for other regular paths (kept
        so that a file written elsewhere and renamed in has its bytes); None for the rest."""
        if path is None:
            return None
        path = path.removesuffix(" (deleted)")
        if path == root_s:
            return "."
        if path.startswith(root_s + os.sep):
            return path[len(root_s) + 1:]
        if path.startswith("/") and path != log_s and (
                path.startswith("/dev/shm/") or not path.startswith(("/dev/", "/proc/", "/sys/"))):
            return path
        return None

    def fd_of(arg: str) -> tuple[int, str | None]:
        m = _FD_PATH_RE.match(arg)
        num = re.match(r"^-?\d+", arg)
        return (int(num.group()) if num else -1), (rel(m.group("path")) if m else None)

    def add(kind: str, path: str, **kw) -> None:
        inside = not path.startswith("/") or not kw.get("target", "/").startswith("/")
        ops.append(Op(len(ops), kind, path, after_step=logged, inside=inside, **kw))

    for line in _joined_lines(text):
        m = _LINE_RE.match(line)
        if m is None or m.group("ret") is None:
            continue
        call, args, ret = m.group("call"), _split_args(m.group("args")), m.group("ret")
        rm = _RET_RE.match(ret)
        if rm is None or int(rm.group("val")) < 0:
            continue  # failed calls change nothing
        value = int(rm.group("val"))
        if call in ("write", "pwrite64", "writev", "pwritev"):
            fm = _FD_PATH_RE.match(args[0])
            if fm and fm.group("path") == log_s:
                logged += 1
                continue
            fd, path = fd_of(args[0])
            if path is None:
                continue
            if call in ("write", "pwrite64"):
                data = _string_arg(args[1])[:value]
            else:
                data = b"".join(_string_arg(s) for s in re.findall(r'iov_base=("(?:[^"\\]|\\.)*"(?:\.\.\.)?)', args[1]))[:value]
            offset = int(args[3]) if call in ("pwrite64", "pwritev") else None
            add("write", path, data=data, offset=offset, fd=fd)
        elif call in ("openat", "open", "creat"):
            path_arg = args[1] if call == "openat" else args[0]
            path = rel(_resolve(args[0] if call == "openat" else None, path_arg))
            flags = (args[2] if call == "openat" else args[1] if call == "open" else "O_CREAT|O_TRUNC") if len(args) > 1 else ""
            if path is None or not any(f in flags for f in ("O_CREAT", "O_TRUNC", "O_WRONLY", "O_RDWR", "O_APPEND")):
                continue
            add("create", path, fd=value, flags=flags)
        elif call == "lseek":
            fd, path = fd_of(args[0])
            if path is not None:
                add("seek", path, fd=fd, offset=value)
        elif call in ("ftruncate", "truncate"):
            if call == "ftruncate":
                fd, path = fd_of(args[0])
            else:
                fd, path = -1, rel(_resolve(None, args[0]))
            if path is not None:
                add("truncate", path, fd=fd, offset=int(args[1]))
        elif call in ("rename", "renameat", "renameat2", "link", "linkat"):
            if call in ("rename", "link"):
                src, dst = _resolve(None, args[0]), _resolve(None, args[1])
            else:
                src, dst = _resolve(args[0], args[1]), _resolve(args[2], args[3])
            s, d = rel(src), rel(dst)
            if s is None or d is None:
                if (s or "/").startswith("/") and (d or "/").startswith("/"):
                    continue   # nothing under the checkpoint directory
                raise UnreplayableTrace(f"{call} from or to a path that is not a regular file: {src} -> {dst}")
            add("rename" if call.startswith("rename") else "link", s, target=d)
        elif call in ("unlink", "unlinkat", "rmdir"):
            path = rel(_resolve(args[0], args[1]) if call == "unlinkat" else _resolve(None, args[0]))
            if path is not None:
                is_dir = call == "rmdir" or (call == "unlinkat" and "AT_REMOVEDIR" in args[2])
                add("rmdir" if is_dir else "unlink", path)
        elif call in ("mkdir", "mkdirat"):
            path = rel(_resolve(args[0], args[1]) if call == "mkdirat" else _resolve(None, args[0]))
            if path is not None and path != ".":
                add("mkdir", path)
        elif call in ("symlink", "symlinkat"):
            target = _string_arg(args[0]).decode("utf-8", "surrogateescape")
            link = rel(_resolve(args[1], args[2]) if call == "symlinkat" else _resolve(None, args[1]))
            if link is not None:
                add("symlink", link, target=target)
        elif call in ("fsync", "fdatasync"):
            fd, path = fd_of(args[0])
            if path is not None:
                add("fsync", path, fd=fd)
    # Operations elsewhere matter only for files that end up under the root: drop the rest.
    feeding = {op.path for op in ops if op.kind in ("rename", "link") and op.inside}
    kept = [op for op in ops if op.inside or any(op.path == f or op.path.startswith(f + "/") for f in feeding)]
    return [dataclasses.replace(op, index=i) for i, op in enumerate(kept)]


# -- the offline filesystem -----------------------------------------------------------------------
class Replayer:
    """Applies recorded operations to an in-memory model of the checkpoint directory."""

    def __init__(self):
        self.files: dict[str, bytearray] = {}
        self.dirs: set[str] = {"."}
        self.symlinks: dict[str, str] = {}
        self.positions: dict[tuple[int, str], int] = {}

    def apply(self, op: Op, *, torn: bool = False) -> None:
        k = op.kind
        if k == "mkdir":
            self.dirs.add(op.path)
        elif k == "create":
            if "O_TRUNC" in op.flags or op.path not in self.files:
                self.files[op.path] = bytearray()
            self.positions[(op.fd, op.path)] = len(self.files[op.path]) if "O_APPEND" in op.flags else 0
        elif k == "write":
            data = op.data[: torn_length(op.data)] if torn else op.data
            buf = self.files.setdefault(op.path, bytearray())
            pos = op.offset if op.offset is not None else self.positions.get((op.fd, op.path), len(buf))
            if pos > len(buf):
                buf.extend(b"\0" * (pos - len(buf)))
            buf[pos:pos + len(data)] = data
            if op.offset is None:
                self.positions[(op.fd, op.path)] = pos + len(data)
        elif k == "seek":
            self.positions[(op.fd, op.path)] = op.offset
        elif k == "truncate":
            buf = self.files.setdefault(op.path, bytearray())
            del buf[op.offset:]
            buf.extend(b"\0" * (op.offset - len(buf)))
        elif k == "rename":
            self._move(op.path, op.target)
        elif k == "link":
            if op.path in self.files:
                self.files[op.target] = bytearray(self.files[op.path])
        elif k == "symlink":
            self.symlinks[op.path] = op.target
        elif k == "unlink":
            self.files.pop(op.path, None)
            self.symlinks.pop(op.path, None)
        elif k == "rmdir":
            self.dirs.discard(op.path)
            # unlinkat(AT_REMOVEDIR) only succeeds on an empty directory, so nothing else goes

    def _move(self, src: str, dst: str) -> None:
        def moved(p: str) -> str | None:
            if p == src:
                return dst
            return dst + p[len(src):] if p.startswith(src + "/") else None
        for table in (self.files, self.symlinks):
            for p in [p for p in table if moved(p)]:
                table[moved(p)] = table.pop(p)
        for p in [p for p in self.dirs if moved(p)]:
            self.dirs.discard(p)
            self.dirs.add(moved(p))
        # os.replace onto an existing directory needs it empty; onto a file it replaces it

    def materialize(self, directory: Path) -> None:
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

    @property
    def label(self) -> str:
        return f"{self.before}{'t' if self.torn else ''}"


def torn_length(data: bytes) -> int:
    """How much of a write a kill landing during it leaves in a torn state: the first half."""
    return max(1, len(data) // 2)


def crash_states(ops: list[Op]) -> list[CrashState]:
    """Every crash state of the recorded run, in order: before each operation under the
    checkpoint directory, and during each write of more than one byte."""
    last_op_of_save: dict[int, int] = {}   # step s -> index of the last op made in s's save window
    for op in ops:
        if op.after_step:
            last_op_of_save[op.after_step] = op.index
    states = []
    for op in ops:
        if not op.inside:
            continue
        newest = max((s for s, last in last_op_of_save.items() if last < op.index), default=0)
        in_progress = op.after_step or None
        states.append(CrashState(op.index, False, f"kill before op #{op.index}: {op.describe()}", newest, in_progress))
        if op.kind == "write" and len(op.data) > 1:
            states.append(CrashState(op.index, True, f"kill during op #{op.index}: {op.describe()}, only the first "
                                     f"{torn_length(op.data)} bytes written", newest, in_progress))
    return states


def build_state(ops: list[Op], state: CrashState, directory: Path) -> None:
    replayer = Replayer()
    for op in ops[: state.before]:
        replayer.apply(op)
    if state.torn:
        replayer.apply(ops[state.before], torn=True)
    if directory.exists():
        shutil.rmtree(directory)
    replayer.materialize(directory)


def probe_specs(spec: RunSpec, state: CrashState) -> list[RunSpec]:
    """Runs that check a state: train one step past the newest committed checkpoint; if the
    trainer instead resumed past that (from the interrupted save, complete by then), one step
    past the interrupted save. One step, never a save: the probe costs a fork and a load."""
    out = [RunSpec(min(spec.total_steps, state.newest_committed + 1), spec.save_every, spec.seed)]
    if state.in_progress and state.in_progress + 1 > out[0].total_steps:
        out.append(RunSpec(min(spec.total_steps, state.in_progress + 1), spec.save_every, spec.seed))
    return out


def resumed_past(result: ProcessResult) -> bool:
    """Exit 0 without training a step: the trainer found a checkpoint at or past total_steps."""
    return result.returncode == 0 and result.first_step is None


def judge_state(state: CrashState, result: ProcessResult, baseline: dict[int, float], spec: RunSpec,
                tol: float) -> str | None:
    """None if the trainer resumed correctly in this state, else what went wrong."""
    allowed = {state.newest_committed} | ({state.in_progress} if state.in_progress else set())
    if result.returncode != 0:
        return f"the trainer exited {result.returncode} (it found a torn or unreadable checkpoint)"
    if result.first_step is None:
        return (f"the trainer exited 0 without training: it resumed from a step at or beyond "
                f"{spec.total_steps}, later than any checkpoint committed before the kill")
    resumed = result.first_step - 1
    if resumed not in allowed:
        want = " or ".join(f"step {s}" for s in sorted(allowed))
        what = "from scratch" if resumed == 0 else f"from step {resumed}"
        return f"the trainer resumed {what}; expected {want} (newest committed before the kill)"
    bad = [(s, loss) for s, loss in sorted(result.losses.items()) if not abs(loss - baseline.get(s, float("nan"))) <= tol]
    if bad:
        s, loss = bad[0]
        return (f"the trainer resumed from step {resumed} but its loss at step {s} is {loss:.8g}, baseline "
                f"{baseline.get(s, float('nan')):.8g}: it loaded incomplete state")
    return None
