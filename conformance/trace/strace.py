"""The one strace parser, and the strace command lines the suite runs.

Everything the suite learns from a trace goes through `parse`: it turns strace's text into typed
`Syscall` records (unfinished/resumed pairs joined, each entry counted per thread as strace's
`inject=...:when=N` counts it, the entry a KILL stopped marked). `recording.py` builds the model
of a run from these; nothing else reads strace output.

strace 6.1 notes: `--seccomp-bpf` is used only where no signal is injected (`observe_argv`,
`record_argv`, and error injections), because with it strace silently skips signal injection. It
takes effect only where strace starts the process, and there it is worth having: without it strace
stops the traced process at every syscall, traced or not, and a fresh interpreter's `import torch`
alone makes tens of thousands that no check looks at (what it saves: docs/benchmarks.md, "Measured by
hand"); an attach (`attach.attach_strace`) drops it. `-P PATH` is used only where it was seen to
inject (`inject_on_path_argv`: a loss log's writes, a path every run shares), counting only the
calls on that path. `when=N` counts per thread and per syscall.
"""
from __future__ import annotations

import codecs
import dataclasses
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

# Every syscall that changes a directory tree or a file's bytes, plus lseek (it moves the offset
# later writes land at), the opens (creating, truncating, or reading: what a resume reads) and mmap
# (a shared writable mapping of a checkpoint file makes the recording unreplayable), and the
# in-kernel copies (sendfile, copy_file_range: shutil.copyfile uses them) whose bytes come from
# another file.
RECORD_SYSCALLS = (
    "write", "pwrite64", "writev", "pwritev", "pwritev2", "openat", "open", "creat", "rename",
    "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "mkdir", "mkdirat", "fsync", "fdatasync",
    "ftruncate", "truncate", "lseek", "link", "linkat", "symlink", "symlinkat", "fallocate", "mmap",
    "sendfile", "copy_file_range", "splice",
)
MAX_DATA_BYTES = 64 * 1024 * 1024   # strace -s for a recording: longer writes cannot be replayed
PATH_BYTES = 4096                   # strace -s for a trace that needs paths, not data

# Each line: the thread id, the entry time with -ttt (seconds since the epoch: how the traces of
# several ranks are merged into one order), then the call.
_HEAD = r"^(?P<tid>\d+)\s+(?:(?P<ts>\d+\.\d+)\s+)?"
_LINE_RE = re.compile(_HEAD + r"(?P<call>[a-z0-9_]+)\((?P<args>.*?)"
                      r"(?:\)\s+=\s+(?P<ret>.*)| <unfinished \.\.\.>)$")
_RESUMED_RE = re.compile(_HEAD + r"<\.\.\. (?P<call>\w+) resumed>(?P<args>.*?)\)\s+=\s+(?P<ret>.*)$")
_KILLED_RE = re.compile(_HEAD + r"\+\+\+ killed by SIG(?P<sig>[A-Z]+)")
# A signal strace injected (si_code=SI_KERNEL), delivered as the injected call returns.
_INJECTED_SIGNAL_RE = re.compile(_HEAD + r"--- SIG(?P<sig>[A-Z]+) \{[^}]*si_code=SI_KERNEL")
_FD_RE = re.compile(r"^(?P<fd>-?\d+|AT_FDCWD)<(?P<path>[^>]*)>")
_STRING_RE = re.compile(r'^"([^"\\]*(?:\\.[^"\\]*)*)"(\.\.\.)?')   # unrolled: a 4 KiB write in one pass
_IOV_BASE_RE = re.compile(r'iov_base=("[^"\\]*(?:\\.[^"\\]*)*"(?:\.\.\.)?)')
_RET_RE = re.compile(r"^(?P<val>-?\d+)(?:<(?P<path>[^>]*)>)?")


class TruncatedString(ValueError):
    """strace cut a string argument short (it was longer than -s)."""


@dataclasses.dataclass(frozen=True)
class Syscall:
    """One syscall entry of a traced process, in the order strace saw the entries."""

    seq: int
    tid: int
    name: str
    nth: int                 # this thread's count of this syscall: what `inject=...:when=N` counts
    args: tuple[str, ...]    # raw argument texts
    ret: str | None          # raw return text; None if the call never returned (killed in it)
    ts: float = 0.0          # entry time (seconds since the epoch), when traced with -ttt
    signalled: str = ""      # a signal strace injected at this call ("TERM"), delivered as it returned

    @property
    def killed(self) -> bool:
        """The process died inside this call (how a KILL injection shows)."""
        return self.ret is None or self.ret.startswith("?")

    @property
    def value(self) -> int | None:
        m = _RET_RE.match(self.ret or "")
        return int(m.group("val")) if m else None

    @property
    def failed(self) -> bool:
        v = self.value
        return v is not None and v < 0

    @property
    def injected_error(self) -> str | None:
        """The errno name strace injected into this call (`= -1 ENOSPC (...) (INJECTED)`), or None."""
        if self.ret is None or "(INJECTED)" not in self.ret:
            return None
        m = re.match(r"^-1 (E[A-Z0-9]+)", self.ret)
        return m.group(1) if m else None

    @property
    def returned_path(self) -> str | None:
        m = _RET_RE.match(self.ret or "")
        return m.group("path") if m else None


# split_args's tokens: a string argument whole (to its closing quote, or to the end of the text if
# it has none), one bracket or comma, or a run of anything else.
_ARG_TOKEN_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)|[\[\]{}()<>,]|[^"\[\]{}()<>,]+', re.DOTALL)
_OPENERS, _CLOSERS = frozenset("[{(<"), frozenset("]})>")


def split_args(args: str) -> tuple[str, ...]:
    """Split strace's argument text at top-level commas (strings, arrays and structs kept whole).
    Token by token, not character by character: a write's data is one token."""
    if "," not in args:
        return (args.strip(),) if args else ()
    out, depth, cur = [], 0, []
    for tok in _ARG_TOKEN_RE.findall(args):
        if tok in _OPENERS:
            depth += 1
        elif tok in _CLOSERS:
            depth -= 1
        elif tok == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(tok)
    if cur:
        out.append("".join(cur).strip())
    return tuple(out)


def parse(text: str) -> list[Syscall]:
    """Every syscall entry in an strace -f -y output, with per-thread counts."""
    counts: dict[tuple[int, str], int] = {}
    out: list[Syscall] = []
    pending: dict[int, tuple[int, str, str]] = {}   # tid -> (slot in out, call, args so far)
    last: dict[int, int] = {}                         # tid -> slot of its latest call
    for line in text.splitlines():
        m = _LINE_RE.match(line)
        if m is not None:
            tid, call = int(m.group("tid")), m.group("call")
            counts[(tid, call)] = counts.get((tid, call), 0) + 1
            slot = len(out)
            last[tid] = slot
            out.append(Syscall(slot, tid, call, counts[(tid, call)], split_args(m.group("args")), m.group("ret"),
                               float(m.group("ts") or 0.0)))
            if m.group("ret") is None:
                pending[tid] = (slot, call, m.group("args"))
            continue
        m = _RESUMED_RE.match(line)
        if m is not None and int(m.group("tid")) in pending:
            slot, call, head = pending.pop(int(m.group("tid")))
            out[slot] = dataclasses.replace(out[slot], args=split_args(head + m.group("args")), ret=m.group("ret"))
            continue
        m = _KILLED_RE.match(line)
        if m is not None:
            pending.pop(int(m.group("tid")), None)   # its unfinished call stays ret=None: killed in it
            continue
        m = _INJECTED_SIGNAL_RE.match(line)
        if m is not None and int(m.group("tid")) in last:
            slot = last[int(m.group("tid"))]
            out[slot] = dataclasses.replace(out[slot], signalled=m.group("sig"))
    return out


# -- reading arguments ------------------------------------------------------------------------------
def decode_string(arg: str) -> bytes:
    """The bytes of a string argument; raises TruncatedString if strace cut it short."""
    m = _STRING_RE.match(arg)
    if m is None:
        raise ValueError(f"not a string argument: {arg[:80]!r}")
    if m.group(2):
        raise TruncatedString(f"strace cut a string argument short: {arg[:60]!r}...")
    return codecs.escape_decode(m.group(1).encode("latin-1", "backslashreplace"))[0]


def string_path(arg: str) -> str | None:
    try:
        return os.fsdecode(decode_string(arg))
    except ValueError:
        return None


def fd_path(arg: str) -> str | None:
    """The path strace -y printed for an fd argument (`3</ck/a>`), or None."""
    m = _FD_RE.match(arg)
    return m.group("path").removesuffix(" (deleted)") if m else None


def fd_number(arg: str) -> int:
    m = re.match(r"^-?\d+", arg)
    return int(m.group()) if m else -1


def resolve(dir_arg: str | None, path_arg: str) -> str | None:
    """An absolute, normalized path from a path argument and its directory-fd argument."""
    path = string_path(path_arg)
    if path is None:
        return None
    if os.path.isabs(path):
        return os.path.normpath(path)
    base = fd_path(dir_arg) if dir_arg is not None else None
    return os.path.normpath(os.path.join(base, path)) if base else None


# Calls that name a file without learning anything of it (offline/unseen.py).
BLIND_CALLS = frozenset({"unlink", "unlinkat", "close"})


@dataclasses.dataclass(frozen=True)
class Named:
    """What a traced process named in calls that can learn something of a file (bytes, size,
    times): absolute paths (fd paths, and path arguments resolved against their directory fd),
    and the base names of relative paths it gave without one."""

    paths: frozenset[str]
    names: frozenset[str]

    def __or__(self, other: Named) -> Named:
        return Named(self.paths | other.paths, self.names | other.names)

    def rebased(self, old: str, new: str) -> Named:
        """What the same process would have named had it run under `new` instead of `old`."""
        def moved(path: str) -> str:
            return new + path[len(old):] if path == old or path.startswith(old + "/") else path
        return Named(frozenset(map(moved, self.paths)), self.names)


def named(text: str) -> Named:
    """Every file a traced process (strace -y) named, except in calls that only remove a name or
    let go of an fd (BLIND_CALLS)."""
    paths: set[str] = set()
    names: set[str] = set()
    for sc in parse(text):
        if sc.name in BLIND_CALLS:
            continue
        for i, arg in enumerate(sc.args):
            path = fd_path(arg)
            if path is None and arg.startswith('"'):
                given = string_path(arg)
                if not given:
                    continue
                path = resolve(sc.args[i - 1] if i else None, arg)   # *at calls: the dir fd comes first
                if path is None:
                    names.add(os.path.basename(given.rstrip("/")))
                    continue
            if path:
                paths.add(os.path.normpath(path))
        if sc.returned_path:
            paths.add(os.path.normpath(sc.returned_path))
    return Named(frozenset(paths), frozenset(names))


# -- command lines ----------------------------------------------------------------------------------
def record_argv(trace_file: Path, *, data: bool) -> list[str]:
    """strace arguments that trace every syscall of RECORD_SYSCALLS: with `data`, every write's
    bytes too (a recording crash states can be rebuilt from); else the paths only."""
    size = MAX_DATA_BYTES if data else PATH_BYTES
    return ["strace", "-f", "-qq", "-y", "-ttt", *(["-x"] if data else []), "-s", str(size), "--seccomp-bpf",
            "-o", str(trace_file), "-e", "trace=" + ",".join(RECORD_SYSCALLS), "--"]


def observe_argv(trace_file: Path) -> list[str]:
    """strace arguments that trace every call naming a path or an fd, paths only (no data): what a
    resume looked at (named). Nothing is injected, so seccomp-bpf may filter (where
    strace starts the process)."""
    return ["strace", "-f", "-qq", "-y", "-s", "0", "--seccomp-bpf", "-o", str(trace_file),
            "-e", "trace=%file,%desc", "--"]


def inject_argv(trace_file: Path, syscall: str, nth: int, *, action: str = "signal=KILL",
                data: bool = False) -> list[str]:
    """strace arguments that trace like record_argv (paths only, or with `data`) and inject
    `action` into this thread's `nth` call of `syscall`."""
    args = record_argv(trace_file, data=data)
    if action.startswith("signal="):
        args.remove("--seccomp-bpf")
    return args[:-1] + ["-e", f"inject={syscall}:{action}:when={nth}", "--"]


def inject_on_path_argv(trace_file: Path, syscall: str, nth: int, path: str, *,
                        action: str = "signal=KILL") -> list[str]:
    """strace arguments that inject `action` (a KILL, by default) into the process's `nth` call of
    `syscall` on `path`, counting only the calls on that path (-P), whatever else the thread
    calls; every recorded syscall on that path is traced. (strace 6.1 injects signals and errors
    together with -P.)"""
    return ["strace", "-f", "-qq", "-y", "-ttt", "-s", str(PATH_BYTES), "-o", str(trace_file), "-P", path,
            "-e", "trace=" + ",".join(RECORD_SYSCALLS), "-e", f"inject={syscall}:{action}:when={nth}", "--"]


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


def written_bytes(sc: Syscall) -> bytes | None:
    """The bytes a successful write call wrote, or None if the trace cut them short."""
    n = sc.value or 0
    try:
        if sc.name in ("write", "pwrite64"):
            return decode_string(sc.args[1])[:n]
        parts = _IOV_BASE_RE.findall(sc.args[1])
        return b"".join(decode_string(p) for p in parts)[:n]
    except (ValueError, IndexError):
        return None
