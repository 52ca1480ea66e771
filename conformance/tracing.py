"""Syscall-level tracing and crash injection with strace, for trainers of any kind.

A crash point is an *event* of a traced, uninterrupted run: the entry of one syscall in one
thread. strace's `inject=SYSCALL:signal=KILL:when=N` counts N per thread, so an event is
targetable only if no other thread reaches its N-th call of that syscall earlier; those that are
not are reported, never silently retargeted. `-P` and `--seccomp-bpf` are never used: with them
strace 6.1 silently skips signal injection.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

MUTATING_SYSCALLS = (
    "write", "pwrite64", "writev", "pwritev", "pwritev2", "rename", "renameat", "renameat2",
    "unlink", "unlinkat", "rmdir", "mkdir", "mkdirat", "fsync", "fdatasync", "openat", "open",
    "creat", "ftruncate", "truncate", "link", "linkat", "symlink", "symlinkat", "fallocate",
)
_CREATE_FLAGS = ("O_CREAT", "O_TRUNC")
_LINE_RE = re.compile(r"^(?P<tid>\d+)\s+(?P<call>[a-z0-9_]+)\((?P<args>.*?)(?:\)\s+=\s+(?P<ret>.*)| <unfinished \.\.\.>)$")
_FD_PATH_RE = re.compile(r"^-?\w+<(?P<path>[^>]*)>")
_STRING_RE = re.compile(r'"((?:[^"\\]|\\.)*)"')


@functools.lru_cache(maxsize=1)
def strace_problem() -> str | None:
    """None if strace can trace and inject here; otherwise the reason, for a skip message."""
    exe = shutil.which("strace")
    if exe is None:
        return "strace is not installed (apt-get install strace)"
    try:
        proc = subprocess.run([exe, "-f", "-qq", "-e", "trace=getppid", "-e",
                               "inject=getppid:signal=KILL:when=1", "--", "python3", "-c",
                               "import os; os.getppid(); print('survived')"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"strace could not run: {exc}"
    if "survived" in proc.stdout:
        return "strace ran but did not inject a signal (is it combined with -P/--seccomp-bpf?)"
    if proc.returncode not in (-9, 137):
        return f"ptrace is not permitted here (strace exited {proc.returncode}: {proc.stderr.strip()[:200]})"
    return None


def strace_prefix(trace_file: Path, *, inject: tuple[str, int] | None = None) -> list[str]:
    """strace arguments to put before a trainer command."""
    args = ["strace", "-f", "-qq", "-y", "-s", "4096", "-o", str(trace_file)]
    if inject is None:
        args += ["-e", "trace=" + ",".join(MUTATING_SYSCALLS)]
    else:
        syscall, nth = inject
        args += ["-e", f"trace={syscall}", "-e", f"inject={syscall}:signal=KILL:when={nth}"]
    return args + ["--"]


def _unescape(s: str) -> str:
    return s.encode("latin-1", "backslashreplace").decode("unicode_escape", "replace")


@dataclasses.dataclass(frozen=True)
class Event:
    """One syscall entry under the run's checkpoint directory (or the loss log)."""

    seq: int           # position among all traced syscall entries of the run
    tid: int
    syscall: str
    nth: int           # this thread's count of this syscall, as strace's `when=` counts it
    paths: tuple[str, ...]
    op: str            # write, rename, unlink, fsync, mkdir, create, truncate, link

    def describe(self, root: Path) -> str:
        rel = [os.path.relpath(p, root) if p.startswith(str(root)) else p for p in self.paths]
        return f"{self.op} {' -> '.join(rel)}"


_OP_OF = {"write": "write", "pwrite64": "write", "writev": "write", "pwritev": "write",
          "pwritev2": "write", "rename": "rename", "renameat": "rename", "renameat2": "rename",
          "unlink": "unlink", "unlinkat": "unlink", "rmdir": "unlink", "mkdir": "mkdir",
          "mkdirat": "mkdir", "fsync": "fsync", "fdatasync": "fsync", "openat": "create",
          "open": "create", "creat": "create", "ftruncate": "truncate", "truncate": "truncate",
          "link": "link", "linkat": "link", "symlink": "link", "symlinkat": "link",
          "fallocate": "write"}


def _split_args(args: str) -> list[str]:
    out, depth, cur, in_str, esc = [], 0, [], False, False
    for ch in args:
        if in_str:
            cur.append(ch)
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "[{(<":
            depth += 1
        elif ch in "]})>":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if cur:
        out.append("".join(cur).strip())
    return out


def _resolve(dir_arg: str | None, path_arg: str) -> str | None:
    m = _STRING_RE.match(path_arg)
    if m is None:
        return None
    path = _unescape(m.group(1))
    if os.path.isabs(path) or dir_arg is None:
        return os.path.normpath(path)
    dm = _FD_PATH_RE.match(dir_arg)
    return os.path.normpath(os.path.join(dm.group("path"), path)) if dm else None


def _paths_of(call: str, args: list[str]) -> tuple[list[str], bool]:
    """(paths the call touches, whether it mutates)."""
    def fd_path(a):
        m = _FD_PATH_RE.match(a)
        return [m.group("path")] if m else []
    if call in ("write", "pwrite64", "writev", "pwritev", "pwritev2", "fsync", "fdatasync",
                "ftruncate", "fallocate"):
        return fd_path(args[0]) if args else [], True
    if call in ("rename", "link", "symlink"):
        return [p for p in (_resolve(None, args[0]), _resolve(None, args[1])) if p], True
    if call in ("renameat", "renameat2", "linkat"):
        return [p for p in (_resolve(args[0], args[1]), _resolve(args[2], args[3])) if p], True
    if call == "symlinkat":
        return [p for p in (_resolve(args[1], args[2]),) if p], True
    if call in ("unlink", "rmdir", "mkdir", "truncate", "creat"):
        return [p for p in (_resolve(None, args[0]),) if p], True
    if call in ("unlinkat", "mkdirat"):
        return [p for p in (_resolve(args[0], args[1]),) if p], True
    if call == "open":
        return [p for p in (_resolve(None, args[0]),) if p], any(f in args[1] for f in _CREATE_FLAGS)
    if call == "openat":
        return [p for p in (_resolve(args[0], args[1]),) if p], len(args) > 2 and any(f in args[2] for f in _CREATE_FLAGS)
    return [], False


@dataclasses.dataclass
class Trace:
    """Parsed output of one traced run: every mutating syscall entry, with per-thread counts."""

    entries: list[Event]

    @classmethod
    def parse(cls, text: str) -> "Trace":
        counts: dict[tuple[int, str], int] = {}
        entries = []
        for line in text.splitlines():
            m = _LINE_RE.match(line)
            if m is None:
                continue
            tid, call = int(m.group("tid")), m.group("call")
            key = (tid, call)
            counts[key] = counts.get(key, 0) + 1
            paths, mutates = _paths_of(call, _split_args(m.group("args")))
            entries.append(Event(len(entries), tid, call, counts[key], tuple(paths),
                                 _OP_OF.get(call, call) if mutates else "read"))
        return cls(entries)

    def under(self, root: Path) -> list[Event]:
        root_s = str(root)
        return [e for e in self.entries if e.op != "read"
                and any(p == root_s or p.startswith(root_s + os.sep) for p in e.paths)]

    def writes_to(self, path: Path) -> list[Event]:
        return [e for e in self.entries if e.op == "write" and str(path) in e.paths]

    def targetable(self, event: Event) -> bool:
        """True if `inject=<syscall>:when=<nth>` lands on this event and nowhere earlier.

        File creation (open/openat with O_CREAT) is never a target: every import and read also
        calls openat, so its per-thread count is not stable from run to run. The state a kill there
        would leave is the state of a kill at the mutation just before it."""
        if event.op == "create":
            return False
        for e in self.entries:
            if e.seq >= event.seq:
                return True
            if e.syscall == event.syscall and e.nth == event.nth:
                return False
        return False


def killed_at(trace_text: str, syscall: str) -> tuple[str, ...] | None:
    """Paths of the `syscall` entry that a KILL injection stopped, or None if it never fired."""
    unfinished: dict[int, tuple[str, list[str]]] = {}
    for line in trace_text.splitlines():
        m = _LINE_RE.match(line)
        if m is not None and m.group("call") == syscall and (m.group("ret") or "").startswith("?"):
            return tuple(_paths_of(syscall, _split_args(m.group("args")))[0])
        if m is not None and m.group("ret") is None:
            unfinished[int(m.group("tid"))] = (m.group("call"), _split_args(m.group("args")))
        km = re.match(r"^(\d+)\s+\+\+\+ killed by SIGKILL", line)
        if km and int(km.group(1)) in unfinished:
            call, args = unfinished[int(km.group(1))]
            if call == syscall:
                return tuple(_paths_of(call, args)[0])
    return None
