"""How a traced run's syscalls become filesystem operations (`Op`): one handler per family of
syscalls, chosen from one table (`Translator.HANDLERS`). `recording.build` runs a Translator over
a parsed trace, then keeps what matters and attributes operations to saves; nothing else turns a
syscall into an operation.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import TYPE_CHECKING

from . import strace

if TYPE_CHECKING:
    from .recording import SourceFile

# Operations that change the directory or a file's bytes (crash points are drawn among these).
MUTATIONS = frozenset({"mkdir", "create", "write", "copy", "truncate", "rename", "unlink", "rmdir", "link",
                       "symlink", "fsync"})
WRITE_CALLS = ("write", "pwrite64", "writev", "pwritev", "pwritev2")
_OPEN_WRITE_FLAGS = ("O_CREAT", "O_TRUNC", "O_WRONLY", "O_RDWR", "O_APPEND")


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
    retention: int = 0         # the retention pass it belongs to, by its save step (0: none; see saves.py)
    source: SourceFile | None = None   # a copy, link or rename from outside what the trace wrote: its source's record

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


class Translator:
    """Turns one process's syscalls, in order, into operations, and notes along the way the
    loss-log writes that mark step boundaries (`step_logs`), the files opened for reading
    (`reads`), what the offline replayer could not rebuild (`unreplayable`) and the files mapped
    writable (`mapped`)."""

    def __init__(self, syscalls: list[strace.Syscall], root: str, loss_log: str, losses, rank: int | None):
        self.root_s, self.log_s, self.rank = root, loss_log, rank
        self.first_to_reach: dict[tuple[str, int], int] = {}
        self.reached_by: dict[tuple[str, int], set[int]] = {}
        for sc in syscalls:
            self.first_to_reach.setdefault((sc.name, sc.nth), sc.seq)
            self.reached_by.setdefault((sc.name, sc.nth), set()).add(sc.tid)
        self.ops: list[Op] = []
        self.step_logs: dict[int, strace.Syscall] = {}
        self.reads: set[str] = set()
        self.unreplayable: list[str] = []
        self.mapped: set[str] = set()
        self.logged = 0
        self.ordered_steps = iter(sorted(losses))

    def run(self, syscalls: list[strace.Syscall]) -> Translator:
        for sc in syscalls:
            if sc.failed and not sc.injected_error:
                self.failed(sc)   # a failed call changes nothing (an injected failure is kept, marked, for landing)
                continue
            handler = self.HANDLERS.get(sc.name)
            if handler is not None:
                handler(self, sc, sc.name, sc.args)
        return self

    def shared_counts(self) -> frozenset[tuple[str, int]]:
        """(syscall, nth) counts that more than one thread reaches."""
        return frozenset(k for k, tids in self.reached_by.items() if len(tids) > 1)

    def rel(self, path: str | None) -> str | None:
        """Relative to the root for paths under it; absolute for other regular paths (a file
        written elsewhere and renamed in keeps its bytes); None for the rest."""
        if path is None:
            return None
        if path == self.root_s:
            return "."
        if path.startswith(self.root_s + os.sep):
            return path[len(self.root_s) + 1:]
        if path.startswith("/") and path != self.log_s and (
                path.startswith("/dev/shm/") or not path.startswith(("/dev/", "/proc/", "/sys/"))):
            return path
        return None

    def targetable(self, sc: strace.Syscall) -> bool:
        return self.first_to_reach.get((sc.name, sc.nth)) == sc.seq

    def add(self, sc: strace.Syscall, kind: str, path: str, **kw) -> None:
        # A rename or link is inside if either end is; a copy (`target`: its source) if its path is.
        inside = not path.startswith("/") or (kind in ("rename", "link") and not kw.get("target", "/").startswith("/"))
        self.ops.append(Op(len(self.ops), kind, path, after_step=self.logged, inside=inside, syscall=sc.name, nth=sc.nth,
                           tid=sc.tid, targetable=kind != "create" and self.targetable(sc), killed=sc.killed,
                           error=sc.injected_error or "", rank=self.rank or 0, ts=sc.ts, signalled=bool(sc.signalled),
                           **kw))

    # -- one handler per family of syscalls --------------------------------------------------
    def failed(self, sc: strace.Syscall) -> None:
        if self.rank is not None and sc.name in ("mkdir", "mkdirat") and (sc.ret or "").startswith("-1 EEXIST"):
            # In a job every rank may create the same directory (DCP's writers do): which one
            # gets EEXIST is a race, so each rank's call counts as its operation, with no effect.
            path = self.rel(strace.resolve(sc.args[0], sc.args[1]) if sc.name == "mkdirat"
                            else strace.resolve(None, sc.args[0]))
            if path is not None and path != ".":
                self.add(sc, "mkdir", path, effect=False)

    def write(self, sc, call, args) -> None:
        if not args:
            return
        if strace.fd_path(args[0]) == self.log_s:
            self.log_write(sc, call)
            return
        path = self.rel(strace.fd_path(args[0]))
        if path is not None:
            self.add(sc, "write", path, data=strace.written_bytes(sc), fd=strace.fd_number(args[0]),
                     offset=int(args[3]) if call in ("pwrite64", "pwritev", "pwritev2") and len(args) > 3 else None)

    def log_write(self, sc, call) -> None:
        """A write to the loss log: a step boundary, or where a fault meant for another call hit."""
        common = dict(inside=False, syscall=call, nth=sc.nth, tid=sc.tid, rank=self.rank or 0, ts=sc.ts,
                      targetable=self.targetable(sc))
        if (sc.signalled or sc.injected_error) and not sc.killed:
            # Kept to tell how far off the count was. A signalled write still logged its step.
            self.ops.append(Op(len(self.ops), "log", self.log_s, after_step=self.logged, signalled=bool(sc.signalled),
                               error=sc.injected_error or "", **common))
        if not sc.killed and not sc.injected_error:
            self.logged = logged_step(sc, self.logged, self.ordered_steps)
            self.step_logs[self.logged] = sc
        else:   # killed about to log step k: at step k - 1 (a resumed process is not at 0)
            self.ops.append(Op(len(self.ops), "log", self.log_s, killed=True,
                               after_step=max(self.logged, logged_step(sc, self.logged, iter(())) - 1), **common))

    def copy(self, sc, call, args) -> None:
        out_arg, in_arg, off_arg = (args[0], args[1], args[2]) if call == "sendfile" else (args[2], args[0], args[1])
        path = self.rel(strace.fd_path(out_arg))
        if path is None:
            return
        source = self.rel(strace.fd_path(in_arg))
        m = re.match(r"^\[(\d+)\]", off_arg.strip())
        explicit_out = call != "sendfile" and len(args) > 3 and "NULL" not in args[3]
        if source is None or m is None or call == "splice" or explicit_out:
            self.unreplayable.append(f"{call} into {path} (its bytes come from {strace.fd_path(in_arg)}, not in the trace)")
        self.add(sc, "copy", path, target=source or "", offset=int(m.group(1)) if m else None,
                 length=sc.value or 0, fd=strace.fd_number(out_arg), data=None)

    def fallocate(self, sc, call, args) -> None:
        path = self.rel(strace.fd_path(args[0]))
        if path is not None:
            self.unreplayable.append(f"fallocate on {path}")
            self.add(sc, "write", path, data=None, fd=strace.fd_number(args[0]))

    def open(self, sc, call, args) -> None:
        dir_arg, path_arg = (args[0], args[1]) if call == "openat" else (None, args[0] if args else "")
        path = self.rel(strace.resolve(dir_arg, path_arg))
        flags = (args[2] if call == "openat" and len(args) > 2 else args[1] if call == "open" and len(args) > 1
                 else "O_CREAT|O_TRUNC|O_WRONLY")
        if path is None:
            return
        if not any(f in flags for f in _OPEN_WRITE_FLAGS):
            if not path.startswith("/") and not sc.killed:
                self.reads.add(path)
            return
        if "O_DIRECT" in flags:
            self.unreplayable.append(f"O_DIRECT writes to {path}")
        kind = "create" if ("O_CREAT" in flags or "O_TRUNC" in flags) else "open"
        self.add(sc, kind, path, fd=sc.value if sc.value is not None else -1, flags=flags)

    def seek(self, sc, call, args) -> None:
        path = self.rel(strace.fd_path(args[0]))
        if path is not None and sc.value is not None:
            self.add(sc, "seek", path, fd=strace.fd_number(args[0]), offset=sc.value)

    def truncate(self, sc, call, args) -> None:
        path = self.rel(strace.fd_path(args[0]) if call == "ftruncate" else strace.resolve(None, args[0]))
        if path is not None:
            self.add(sc, "truncate", path, fd=strace.fd_number(args[0]) if call == "ftruncate" else -1,
                     offset=int(args[1]))

    def rename(self, sc, call, args) -> None:
        if call in ("rename", "link"):
            src, dst = strace.resolve(None, args[0]), strace.resolve(None, args[1])
        else:
            src, dst = strace.resolve(args[0], args[1]), strace.resolve(args[2], args[3])
        s, d = self.rel(src), self.rel(dst)
        if s is None or d is None:
            if not ((s or "/").startswith("/") and (d or "/").startswith("/")):   # else nothing under the root
                self.unreplayable.append(f"{call} from or to a path that is not a regular file: {src} -> {dst}")
            return
        self.add(sc, "rename" if call.startswith("rename") else "link", s, target=d)

    def unlink(self, sc, call, args) -> None:
        path = self.rel(strace.resolve(args[0], args[1]) if call == "unlinkat" else strace.resolve(None, args[0]))
        if path is not None:
            is_dir = call == "rmdir" or (call == "unlinkat" and len(args) > 2 and "AT_REMOVEDIR" in args[2])
            self.add(sc, "rmdir" if is_dir else "unlink", path)

    def mkdir(self, sc, call, args) -> None:
        path = self.rel(strace.resolve(args[0], args[1]) if call == "mkdirat" else strace.resolve(None, args[0]))
        if path is not None and path != ".":
            self.add(sc, "mkdir", path)

    def symlink(self, sc, call, args) -> None:
        link = self.rel(strace.resolve(args[1], args[2]) if call == "symlinkat" else strace.resolve(None, args[1]))
        if link is not None:
            self.add(sc, "symlink", link, target=strace.string_path(args[0]) or "")

    def fsync(self, sc, call, args) -> None:
        path = self.rel(strace.fd_path(args[0]))
        if path is not None:
            self.add(sc, "fsync", path, fd=strace.fd_number(args[0]))

    def mmap(self, sc, call, args) -> None:
        if len(args) > 4 and "PROT_WRITE" in args[2] and "MAP_SHARED" in args[3]:
            path = self.rel(strace.fd_path(args[4]))
            if path is not None:
                self.mapped.add(path)   # matters only for a file under the root, or one renamed into it

    HANDLERS = {
        **dict.fromkeys(WRITE_CALLS, write),
        **dict.fromkeys(("sendfile", "copy_file_range", "splice"), copy),
        "fallocate": fallocate,
        **dict.fromkeys(("openat", "open", "creat"), open),
        "lseek": seek,
        **dict.fromkeys(("ftruncate", "truncate"), truncate),
        **dict.fromkeys(("rename", "renameat", "renameat2", "link", "linkat"), rename),
        **dict.fromkeys(("unlink", "unlinkat", "rmdir"), unlink),
        **dict.fromkeys(("mkdir", "mkdirat"), mkdir),
        **dict.fromkeys(("symlink", "symlinkat"), symlink),
        **dict.fromkeys(("fsync", "fdatasync"), fsync),
        "mmap": mmap,
    }


def logged_step(sc: strace.Syscall, previous: int, ordered_steps) -> int:
    """The step a loss-log write logged: read from its JSON line, else the next logged step."""
    try:
        text = strace.decode_string(sc.args[1]).decode("utf-8", "replace")
        steps = [int(json.loads(line)["step"]) for line in text.splitlines() if line.strip()]
        if steps:
            return max(steps)
    except (ValueError, KeyError, TypeError, IndexError):
        pass
    return next(ordered_steps, previous + 1)
