"""How long a trainer process (or job) may run, and what stops it: limits, planned stops, and the
watchdog that reads the loss logs and traces as they grow, and watches the job's processes in /proc.

"No progress" does not depend on how loaded the machine is: a process that is runnable but waits
for a CPU is not hung (see `progressed`).

A trainer's exit ends its run: what it started and left running (a data server, a logging
service) is found by the run's mark (guardian.run_mark), its process tree and what its straces
still follow, watched a moment for writes under the checkpoint directory, recorded and ended
(`Helpers`); no strace waits for it."""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import signal
import time
from pathlib import Path

from ..model import evidence
from ..model.process import ProcessResult, RunSpec, rank_log
from ..trace import strace
from .attach import announced, attach_strace
from .guardian import marked, marked_env, run_mark
from .proctree import (  # noqa: F401  (TaskSample, progressed: re-exported)
    TaskSample,
    children,
    comm,
    command_line,
    dying,
    exited,
    kill_tree,
    open_paths,
    parent_of,
    proc_text,
    process_tree,
    progressed,
    sample_tree,
    start_time,
    tracees,
    tracers,
)
from .where import (  # noqa: F401  (syscall_name: re-exported)
    PY_SPY_MISSING,
    environ_ranks,
    last_syscall,
    log_holders,
    py_spy,
    release_from_tracer,
    syscall_name,
    where,
)
from .zygote import ZYGOTE_COMM

GRACE_EXPIRED = "still running at the end of the grace period"
HELPER_WATCH_S = 0.5   # how long helpers a trainer left running are watched for writes before they are ended
_TID = re.compile(r"^(\d+)\s")   # a trace line's thread id
# The suite's own processes in a run's tree, never a trainer's helper: its tracers, a warm job's zygote.
SUITE_COMMS = frozenset({"strace", ZYGOTE_COMM})
STARVED_NOTE_S = 0.1   # waits for a CPU shorter than this are not worth a word in the message
GRACE_STRETCH = 4.0    # waits for a CPU stretch a grace at most this many times (see Watchdog._grace_over)


def grace_expired(stopped: str) -> bool:
    """Whether a planned stop (ProcessResult.stopped) was the end of a grace period: the process
    was still running, not stopped because it had done what was waited for."""
    return GRACE_EXPIRED in stopped


class ProcessOverran(Exception):
    """A trainer process broke a time or size limit and was killed; the message says which, and
    `details` what each of its processes was doing then."""

    def __init__(self, problem: str, result: ProcessResult, details: str = ""):
        super().__init__(problem)
        self.problem, self.result, self.details = problem, result, details


@dataclasses.dataclass(frozen=True)
class Limits:
    """How long one trainer process may run, how long it may go without progress (see
    `progressed`), and how large its strace output may grow. Derived from the baseline's duration
    (see checks/session.py). A job never counts as stalled before `job_stall_s`: a rank waiting in
    a collective for a slow peer is not hung (the suite's trainers set a 120 s collective timeout,
    and the suite sets none of its own)."""

    total_s: float = 600.0
    stall_s: float = 120.0
    job_stall_s: float = 60.0
    trace_bytes: int = int(os.environ.get("CONFORMANCE_TRACE_CAP", str(4 << 30)))


@dataclasses.dataclass(frozen=True)
class Stop:
    """A planned end for a process, besides its own exit: after it logs a step (it went on
    training past the point of interest), or a grace period after a SIGTERM reached it (what a
    scheduler does: SIGTERM, wait, SIGKILL)."""

    after_step: int | None = None
    grace_s: float | None = None
    signal: str = "TERM"      # the signal the grace period counts from: TERM (a scheduler), INT (Ctrl-C),
    #                           STOP (one rank frozen: the job ends the stop when one of its processes exits)
    node: int | None = None   # a node point: once its rank is seen stopped (SIGSTOP), node `node` is lost
    #                           whole (the runner's on_signal), and the other nodes get grace_s to notice


def _snapshot(directory: Path | None) -> dict[str, tuple[int, int, int]]:
    """relative path -> (size, mtime ns, inode) of everything under `directory`."""
    found: dict[str, tuple[int, int, int]] = {}
    if directory is None:
        return found
    for top, dirs, files in os.walk(directory):
        for name in (*dirs, *files):
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            found[os.path.relpath(path, directory)] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return found


# Calls that change a file, by where they name it: the file of an fd argument (the one they write
# to), a path argument (with the directory fd before it for the *at calls), or several.
_FD_AT = {"write": 0, "pwrite64": 0, "writev": 0, "pwritev": 0, "pwritev2": 0, "ftruncate": 0, "fallocate": 0,
          "sendfile": 0, "copy_file_range": 2, "splice": 2}
_PATHS_AT = {"open": ((None, 0),), "creat": ((None, 0),), "truncate": ((None, 0),), "unlink": ((None, 0),),
             "rmdir": ((None, 0),), "mkdir": ((None, 0),), "openat": ((0, 1),), "unlinkat": ((0, 1),),
             "mkdirat": ((0, 1),), "rename": ((None, 0), (None, 1)), "link": ((None, 0), (None, 1)),
             "symlink": ((None, 1),), "renameat": ((0, 1), (2, 3)), "renameat2": ((0, 1), (2, 3)),
             "linkat": ((0, 1), (2, 3)), "symlinkat": ((1, 2),)}
_OPEN_WRITES = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")


def _changed_paths(sc: strace.Syscall) -> list[str]:
    """The absolute paths one traced call changed (an open only with one of _OPEN_WRITES)."""
    if sc.name in _FD_AT:
        at = _FD_AT[sc.name]
        path = strace.fd_path(sc.args[at]) if len(sc.args) > at else None
        return [path] if path else []
    if sc.name in ("open", "openat") and not any(f in " ".join(sc.args[1:3]) for f in _OPEN_WRITES):
        return []
    paths = []
    for dir_at, path_at in _PATHS_AT.get(sc.name, ()):
        if len(sc.args) > path_at:
            paths.append(strace.resolve(sc.args[dir_at] if dir_at is not None else None, sc.args[path_at]))
    return [p for p in paths if p]


@dataclasses.dataclass
class _Left:
    """A helper the suite found running once its trainer had exited: what it saw of it, before it ended it."""

    pid: int
    command: str
    tids: frozenset[int]
    paths: list[str]              # what it wrote under the checkpoint directory, as far as seen


class Helpers:
    """What the trainer processes of one run started and left running when they exited. The
    processes of the run's tree that are no trainer, launcher or suite process are known as they
    are sampled (`saw`); one found still running once its trainer has exited is watched
    HELPER_WATCH_S for what it writes under the checkpoint directory, then ended with what it
    started (SIGKILL: `end`). At the run's end (`record`, its straces exited and their traces
    whole), what each wrote after its trainer's last traced line is read from the traces too: a
    helper that wrote and exited by itself at once is reported as well."""

    def __init__(self, ckpt_dir: Path | None):
        self.ckpt_dir = ckpt_dir.resolve() if ckpt_dir is not None else None
        self.known: dict[int, str] = {}  # pid -> command line of each helper candidate sampled in the tree
        self.left: list[_Left] = []
        self.changed: set[str] = set()   # paths changed while only helpers ran
        self.handled: set[int] = set()

    def saw(self, pid: int) -> None:
        """`pid`, sampled in the run's tree, is no trainer, launcher or suite process: if it is
        still running when its trainer has exited, it is a helper."""
        if pid not in self.known:
            self.known[pid] = command_line(pid)

    def _relative(self, path: str) -> str | None:
        if self.ckpt_dir is None:
            return None
        rel = os.path.relpath(os.path.normpath(path), self.ckpt_dir)
        return None if rel == ".." or rel.startswith("../") else rel

    def end(self, pids: list[int], *, alone: bool) -> None:
        """End `pids`, processes a trainer process of the run left running once it exited (those
        not handled yet). With `alone` (nothing else of the run runs), any change under the
        checkpoint directory while they are watched is theirs: a file one of them holds open is
        its, and with one helper, everything is (what the run's traces show is read at `record`)."""
        pids = [p for p in dict.fromkeys(pids) if p not in self.handled and not dying(p)]
        if not pids:
            return
        self.handled.update(pids)
        left = [_Left(p, command_line(p), frozenset(int(t) for t in _listdir(f"/proc/{p}/task")) | {p}, [])
                for p in pids]
        before = _snapshot(self.ckpt_dir) if alone else {}
        deadline = time.monotonic() + HELPER_WATCH_S
        while time.monotonic() < deadline and not all(exited(p) for p in pids):
            time.sleep(0.02)
        held = {p: {r for path in open_paths(p) if (r := self._relative(path))} for p in pids}
        for pid in pids:
            kill_tree(pid)
        after = _snapshot(self.ckpt_dir) if alone else {}
        changed = {path for path in {*before, *after} if before.get(path) != after.get(path)}
        for helper in left:
            helper.paths += sorted(changed if len(left) == 1 else held[helper.pid] & changed)
        self.changed |= changed
        self.left += left

    def _traced(self, traces: list[Path]) -> dict[int, list[str]]:
        """pid -> what each helper (found running, or only sampled) changed under the checkpoint
        directory after the last line in its trace of any other process (the trainer's exit, or
        its last traced call: nothing of the trainer ran after it). A trace's first line is its
        trainer's (strace started it, or attached to it); the lines after its last are read from
        the trace's end."""
        owner = {tid: h.pid for h in self.left for tid in h.tids} | {pid: pid for pid in self.known}
        found: dict[int, list[str]] = {}
        for trace in traces:
            tail = _after_others(trace, owner)
            for sc in strace.parse("\n".join(tail)):
                if sc.tid in owner:
                    found.setdefault(owner[sc.tid], []).extend(r for p in _changed_paths(sc) if (r := self._relative(p)))
        return found

    def record(self, traces: list[Path]) -> None:
        """Fold what the run's trainers left into the test's evidence (evidence.helpers_left):
        each helper found running (ended by the suite), and each that wrote under the checkpoint
        directory after its trainer exited and then exited by itself (`traces`: the run's, whole)."""
        traced = self._traced(traces) if self.left or self.known else {}
        found = []
        for helper in self.left:
            paths = tuple(dict.fromkeys([*helper.paths, *traced.pop(helper.pid, [])]))
            found.append(evidence.Helper(helper.pid, helper.command, bool(paths), paths))
        found += [evidence.Helper(pid, self.known[pid], True, tuple(dict.fromkeys(paths)), ended=False)
                  for pid, paths in traced.items() if paths]
        if found:
            theirs = {path for helper in found for path in helper.paths}
            evidence.helpers_left(tuple(found), tuple(sorted(self.changed - theirs)))
        self.left, self.changed = [], set()


def _after_others(trace: Path, helpers: dict[int, int], block: int = 1 << 20) -> list[str]:
    """The lines at the end of `trace` that follow the last line of any thread not in `helpers`
    (but never the trace's first thread, its trainer's), read backwards a block at a time."""
    try:
        with open(trace, "rb") as f:
            first = _TID.match(f.readline().decode(errors="replace"))
            trainer = int(first.group(1)) if first else None
            end = f.seek(0, os.SEEK_END)
            kept: list[str] = []
            partial = b""
            while end > 0:
                start = max(0, end - block)
                f.seek(start)
                data = f.read(end - start) + partial
                lines = data.split(b"\n")
                partial = lines.pop(0) if start else b""
                for raw in reversed(lines):
                    line = raw.decode(errors="replace")
                    m = _TID.match(line)
                    if m and (int(m.group(1)) not in helpers or int(m.group(1)) == trainer):
                        return kept[::-1]
                    if m:
                        kept.append(line)
                end = start
            return kept[::-1]
    except OSError:
        return []


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


WAIT_SAMPLE_S = 1.0   # how long a stalled process's system calls are watched, to tell what it waits on
# Calls that ask whether a file exists (what a loop waiting for a lock file to go away makes, between
# sleeps: torch's FileBaton, under which DeepSpeed builds its ops), and calls that wait for a lock.
_EXISTS_CALLS = frozenset({"stat", "lstat", "newfstatat", "fstatat64", "statx", "access", "faccessat",
                           "faccessat2"})
_LOCK_CALLS = {"x86_64": {72: "fcntl", 73: "flock"}, "aarch64": {25: "fcntl", 32: "flock"}}.get(platform.machine(), {})


@dataclasses.dataclass(frozen=True)
class Waiting:
    """What a stalled process waits on, as far as its system calls show: the file (None: the suite
    cannot tell), and what showed it (or what the suite saw)."""

    path: str | None
    how: str


def _checked_path(sc: strace.Syscall) -> str | None:
    """The file an existence check (`_EXISTS_CALLS`) or an exclusive create that found it (a lock
    file taken by another) asks about."""
    if sc.name in ("stat", "lstat", "access") and sc.args:
        return strace.resolve(None, sc.args[0])
    if sc.name in _EXISTS_CALLS and len(sc.args) > 1:
        return strace.resolve(sc.args[0], sc.args[1])
    if sc.name == "openat" and len(sc.args) > 2 and "O_EXCL" in sc.args[2] and "EEXIST" in (sc.ret or ""):
        return strace.resolve(sc.args[0], sc.args[1])
    if sc.name == "open" and len(sc.args) > 1 and "O_EXCL" in sc.args[1] and "EEXIST" in (sc.ret or ""):
        return strace.resolve(None, sc.args[0])
    return None


def _blocked_on_lock(pid: int) -> Waiting | None:
    """A thread of `pid` blocked taking a lock (flock, fcntl) on a file it holds open: that file."""
    for tid in sorted(int(t) for t in _listdir(f"/proc/{pid}/task")):
        fields = (proc_text(f"/proc/{pid}/task/{tid}/syscall") or "").split()
        call = _LOCK_CALLS.get(int(fields[0])) if fields and fields[0].isdigit() else None
        if call is None:
            continue
        try:
            path = os.readlink(f"/proc/{pid}/fd/{int(fields[1], 16)}")
        except (OSError, ValueError, IndexError):
            continue
        return Waiting(path, f"thread {tid} is blocked in {call} on it, waiting for the lock on it to be released")
    return None


def _judge_sample(calls: list[strace.Syscall], seconds: float) -> Waiting:
    """What a stalled process's system calls over `seconds` show it waits on."""
    checks: dict[str, int] = {}
    for sc in calls:
        path = _checked_path(sc)
        if path:
            checks[path] = checks.get(path, 0) + 1
    others = {}
    for sc in calls:
        if _checked_path(sc) is None:
            others[sc.name] = others.get(sc.name, 0) + 1
    rest = ", ".join(f"{n} {name}" for name, n in sorted(others.items(), key=lambda kv: -kv[1])[:5]) or "nothing else"
    if len(checks) == 1 and next(iter(checks.values())) >= 2:
        path, n = next(iter(checks.items()))
        state = ("it exists: if it is a lock file that a process killed while holding it left behind, it stays until "
                 "it is removed, and every later process waits on it" if os.path.lexists(path) else
                 "it does not exist now")
        return Waiting(path, f"in {seconds:g} s it checked {n} times whether that file exists, and made no other call "
                             f"that names a file ({rest}); {state}")
    if not calls:
        return Waiting(None, f"it made no system call in {seconds:g} s")
    named = ", ".join(f"{p} ({n}x)" for p, n in list(checks.items())[:3])
    return Waiting(None, f"in {seconds:g} s it made {len(calls)} system calls ({rest})"
                         + (f", and checked whether these files exist: {named}" if checks else ""))


def _main_thread(pid: int) -> str:
    """Where a process's main thread is, as "its main thread was ...": its system call, and the
    kernel function it sleeps in."""
    if dying(pid):
        return "it had exited (or was exiting)"
    call = last_syscall(pid, pid)
    wchan = (proc_text(f"/proc/{pid}/wchan") or "").strip()
    where = call if call in ("running", "not in a syscall", "unknown") else f"in {call}"
    return f"its main thread was {where}" + (f" (wchan {wchan})" if wchan and wchan != "0" else "")


def waiting_on(pids: list[int], scratch: Path) -> dict[int, Waiting]:
    """What each stalled process waits on: a lock it is blocked taking (/proc: no tracer needed),
    else what its system calls over WAIT_SAMPLE_S show (strace attached to all of them at once:
    each must have no tracer left); where neither tells, what the suite saw."""
    found = {pid: w for pid in pids if (w := _blocked_on_lock(pid)) is not None}
    seen = {pid: _main_thread(pid) for pid in pids}   # before strace stops it
    sampled = {}
    for pid in pids:
        if pid in found:
            continue
        out = scratch / f"stalled-{pid}.strace"
        try:
            sampled[pid] = (attach_strace(["strace", "-f", "-y", "-s", "512", "-o", str(out)], pid), out)
        except RuntimeError as exc:
            found[pid] = Waiting(None, f"its system calls could not be watched ({' '.join(str(exc).split())[:200]}); "
                                       f"{seen[pid]}")
    if sampled:
        time.sleep(WAIT_SAMPLE_S)
    for pid, (tracer, out) in sampled.items():
        tracer.release()   # the process still runs: strace detaches and writes what it has
        try:
            calls = strace.parse(out.read_text(errors="replace"))
            out.unlink()
        except OSError:
            calls = []
        found[pid] = _judge_sample(calls, WAIT_SAMPLE_S)
        if found[pid].path is None:
            found[pid] = Waiting(None, f"{found[pid].how}; {seen[pid]}")
    return found


class Watchdog:
    """Reads the loss logs (and the traces) as they grow and says when a process must be stopped,
    and why. `planned` is set when the stop was a planned one, not a broken limit. For a job,
    `on_signal(signum)` runs once when a traced rank is seen getting the stop's signal (to pass it
    to the whole job, as a scheduler does with SIGTERM and a terminal with Ctrl-C's SIGINT).

    Once the runner names the launched process (`follow`), the watchdog samples its process tree
    in /proc every `sample_s`: a logged step or any sign of life there (`progressed`) is progress,
    and only `stall_s` without either stops it, with where each process was in the message. For a
    job the launched process is torchrun's agent, which polls its ranks every few milliseconds: its
    own threads are reported but not counted, its descendants (ranks, their straces) are."""

    def __init__(self, limits: Limits, spec: RunSpec, loss_log: Path, trace_files: list[Path],
                 stop: Stop | None = None, on_signal=None, ckpt_dir: Path | None = None):
        self.limits, self.spec, self.trace_files = limits, spec, list(trace_files)
        self.mark = run_mark()               # in the run's environment (`env`): its processes carry it
        self.stalled: dict[int, int] = {}    # a stall: the trainer processes read for it -> their rank (0)
        self.helpers = Helpers(ckpt_dir)     # what its trainer processes left running, ended
        self.straces: list[int] = []         # the straces in its process tree at the last sample
        self.logs = [loss_log] if not spec.is_job else [rank_log(loss_log, r, spec.world_size) for r in range(spec.world_size)]
        self.stop = stop or Stop()
        self.on_signal = on_signal
        self.start = self.progress_at = time.monotonic()
        self.offsets = [0] * len(self.logs)
        self.partials = [b""] * len(self.logs)
        self.rank_steps = [0] * len(self.logs)   # the last step each log (rank) showed
        self.planned: str | None = None
        self.details = ""   # with an unplanned stop: each rank's state and where each process was
        self.signalled_at: float | None = None
        self.trace_offsets = [0] * len(self.trace_files)
        self.stall_s = min(max(limits.stall_s, limits.job_stall_s), limits.total_s) if spec.is_job else limits.stall_s
        self.sample_s = min(1.0, max(0.05, self.stall_s / 10))
        self.roots: list[int] = []   # the launched processes: one, or a multi-node job's agents
        self.seen: dict[int, str] = {}   # every process of the run sampled so far -> its start time
        self.announced: Path | None = None   # where a warm job's ranks announce their pids (attach.announced)
        self.sampled_at = 0.0
        self.tasks: dict[int, TaskSample] | None = None
        self.waits_at_signal: dict[int, int] | None = None   # _waits() when the stop's signal was seen
        self.starved_s, self.grace_sampled_at = 0.0, 0.0      # see _grace_over
        self.peers: set[int] | None = None   # a SIGSTOP stop: the job's processes when it was seen
        self.peers_at = 0.0

    def follow(self, pid: int) -> None:
        """Watch the process tree under `pid`, a process the runner just launched (each agent of a
        multi-node job); the time limits count from the first, not from the start of a fork
        server that a loaded machine may take many seconds to import torch in."""
        if not self.roots:
            self.start = self.progress_at = time.monotonic()
        self.roots, self.tasks = [*self.roots, pid], None

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """The environment the run's processes start with: `env` and the run's mark."""
        return marked_env(env, self.mark)

    def _sample(self, now: float) -> None:
        if not self.roots or now - self.sampled_at < self.sample_s:
            return
        interval, self.sampled_at = now - self.sampled_at, now
        pids = self.tree()
        for pid in pids:
            self.seen.setdefault(pid, start_time(pid))
        names = {pid: comm(pid) for pid in pids}
        self.straces = [pid for pid, name in names.items() if name == "strace"]
        for pid in pids:
            if pid in self.roots or names[pid] in SUITE_COMMS or pid in self.helpers.known:
                continue
            parent = parent_of(pid)
            launched = names.get(parent) in SUITE_COMMS or parent in self.roots and self.spec.is_job
            if not launched:   # not a trainer (strace's child, a rank), nor a launcher: a trainer started it
                self.helpers.saw(pid)
        tasks = sample_tree(pids, skip=frozenset(self.roots) if self.spec.is_job else frozenset())
        if self.tasks is not None and progressed(self.tasks, tasks, interval):
            self.progress_at = now
        self.tasks = tasks

    def release_tracers(self) -> None:
        """A strace of the run (one it started: fresh runs) with no child left has seen its command
        (the trainer, a rank) exit and reaped it: what it still traces are processes the trainer
        left running, which strace -f follows and would wait for, and its launcher (the runner, or
        torchrun's agent) with it. They are ended (`Helpers.end`), and strace exits with its
        command's status. Alone for a single process; a job's other ranks may still run."""
        for tracer in self.straces:
            if exited(tracer) or children(tracer):
                continue
            left = [p for p in tracees(tracer) if p not in self.helpers.handled]
            if left:
                self.helpers.end(left, alone=not self.spec.is_job)

    def end_leftovers(self) -> None:
        """Once the run's launched processes have ended: end every process of the run still alive.
        Those the trainer started and left (its run mark, or sampled in its tree, the same process:
        its start time has not changed) are its helpers, watched and recorded (`Helpers.end`); a
        rank whose agent is gone, in a session of its own, is out of its job's process group and
        tree; a warm job's zygote and a tracer are the suite's own."""
        run = [pid for pid in dict.fromkeys([*self.tree(), *self.seen, *marked(self.mark)])
               if pid not in self.seen or start_time(pid) == self.seen[pid]]
        left = [pid for pid in run if pid not in self.roots and not dying(pid) and comm(pid) not in SUITE_COMMS]
        self.helpers.end(left, alone=True)
        for pid in run:
            kill_tree(pid)

    def tree(self) -> list[int]:
        """Every process of the run: each launched process and its descendants."""
        return [pid for root in self.roots for pid in process_tree(root)]

    def _read_steps(self) -> None:
        for i, log in enumerate(self.logs):
            try:
                with open(log, "rb") as f:
                    f.seek(self.offsets[i])
                    chunk = f.read()
            except OSError:
                continue
            self.offsets[i] += len(chunk)
            lines = (self.partials[i] + chunk).split(b"\n")
            self.partials[i] = lines.pop()
            for line in lines:
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue
                if step > self.last_step or self.last_step == 0:
                    self.progress_at = time.monotonic()
                self.rank_steps[i] = max(self.rank_steps[i], step)

    def _waits(self) -> dict[int, int]:
        """tid -> ns it has waited runnable for a CPU, for every thread of the run and its tracers."""
        pids = self.tree()
        return {tid: t.waited for tid, t in sample_tree(pids + tracers(pids)).items()}

    def _grace_over(self, now: float) -> bool:
        """Whether the grace after the stop's signal is over. After SIGTERM or SIGINT, which the
        trainer must act on, it counts time the run could use: the wall time since the signal less
        the longest any of its threads (or their tracers) has since waited runnable for a CPU, up
        to GRACE_STRETCH times the grace. On a quiet machine that is the wall time; on a loaded one
        a trainer that exits in time whenever it gets a CPU is not killed for the machine's load
        (soak seed 3548310241: ddp_async_trainer's interrupt, 2 ranks on 2 busy CPUs), while one
        that blocks or sleeps waits on no run queue and is killed on time. A frozen rank's grace
        (hang, a lost node) is how long the others may wait, and stays wall time: threads that
        spin while they wait would otherwise stretch it, several times over for a broken trainer's hang."""
        wall = now - self.signalled_at
        if wall <= self.stop.grace_s:
            return False
        if self.stop.signal not in ("TERM", "INT") or wall > GRACE_STRETCH * self.stop.grace_s:
            return True
        if now - self.grace_sampled_at >= self.sample_s:
            self.grace_sampled_at = now
            at_signal = self.waits_at_signal or {}
            self.starved_s = max((w - at_signal.get(tid, 0) for tid, w in self._waits().items()), default=0) / 1e9
        return wall - self.starved_s > self.stop.grace_s

    def _signal_seen(self) -> bool:
        """Whether strace's output shows the signal (`Stop.signal`) delivered (it writes each line as
        it happens)."""
        for i, trace_file in enumerate(self.trace_files):
            if self.signalled_at is not None:
                break
            start = max(0, self.trace_offsets[i] - 32)   # a marker may straddle two reads
            try:
                with open(trace_file, "rb") as f:
                    f.seek(start)
                    chunk = f.read()
            except OSError:
                continue
            self.trace_offsets[i] = start + len(chunk)
            if f"--- SIG{self.stop.signal} ".encode() in chunk:
                self.signalled_at = time.monotonic()
                self.waits_at_signal = self._waits() if self.stop.signal in ("TERM", "INT") else None
                # a stopped rank stays alone, unless it stands for its whole node (a node point)
                if self.on_signal is not None and (self.stop.signal != "STOP" or self.stop.node is not None):
                    self.on_signal(getattr(signal, f"SIG{self.stop.signal}"))
        return self.signalled_at is not None

    def _where_now(self) -> str:
        """Each rank's state (its last step, whether its process is still there) and where each
        process of the run is, with the stacks of the trainer's processes: read just before the run
        is killed (their straces are let go of first, so py-spy can attach)."""
        pids, total = self.tree(), self.spec.total_steps
        held = log_holders(pids, self.logs)
        if self.spec.is_job:   # which process is which rank, by what it holds, its environment, its announcement
            held = {**environ_ranks(pids), **{p: r for p, r in announced(self.announced).items() if p in pids},
                    **held}
        elif not held and pids:   # a single process that keeps no log open: the launched one (strace's child)
            root = self.roots[0]
            held = {next(iter(children(root)), root) if comm(root) == "strace" else root: 0}
        self.stalled = held
        for pid in held:
            release_from_tracer(pid)
        lines = []
        for i in range(len(self.logs)):
            who = f"rank {i}" if self.spec.is_job else "the trainer"
            step = self.rank_steps[i]
            done = f"logged its last step ({step} of {total})" if step >= total else \
                f"logged up to step {step}" if step else "logged no step"
            pid = next((p for p, r in held.items() if r == i), None)
            state = ("no process of it is left" if pid is None else
                     f"pid {pid} still running: hung at exit" if step >= total else f"pid {pid} still running")
            lines.append(f"  {who}: {done}; {state}")
        if not py_spy():
            lines.append(f"  ({PY_SPY_MISSING})")
        labels = {pid: (f"rank {r}" if self.spec.is_job else "the trainer") for pid, r in held.items()}
        if self.spec.is_job:
            labels.update({root: "torchrun's agent" for root in self.roots})
        return ("\n".join(lines) + "\n  where each process was:\n"
                + where(pids, detail=frozenset(held) or None, labels=labels))

    def _stall_waits(self) -> str:
        """What each stalled trainer process (`stalled`, read by _where_now) waits on, as far as its
        system calls show (`waiting_on`): "; stalled before step 1, waiting on /path (...)" per
        process, or what the suite saw where it cannot tell."""
        found = waiting_on(list(self.stalled), self.logs[0].parent)
        parts = []
        for pid, rank in self.stalled.items():
            step = self.rank_steps[rank]
            who = f"rank {rank} " if self.spec.is_job else ""
            when = "at exit" if step >= self.spec.total_steps else f"after step {step}" if step else "before step 1"
            wait = found[pid]
            parts.append(f"{who}stalled {when}, waiting on {wait.path} ({wait.how})" if wait.path else
                         f"{who}stalled {when}; the suite cannot tell what it waits on: {wait.how}")
        return "".join(f"; {part}" for part in parts)

    @property
    def last_step(self) -> int:
        """The newest step any log (rank) showed (0: none yet)."""
        return max(self.rank_steps)

    def _a_peer_exited(self) -> bool:
        """Whether a process of the job (not its agent, not a tracer) present when the SIGSTOP was
        seen has exited since: a rank noticed its stopped peer (a collective timed out) and the job
        is ending. The stopped rank cannot exit (only SIGKILL ends a stopped process). The peers
        are read once, when the stop is first seen (a fresh sample: a fast job may reach its stop
        before the periodic sample has seen its ranks); after that, from the progress samples of
        the job's processes (`_sample`), not a walk of /proc of its own."""
        if self.peers is None:
            fresh = sample_tree(self.tree(), skip=frozenset(self.roots))
            self.peers = {t.pid for t in fresh.values() if t.tid == t.pid and t.name != "strace"}
            self.peers_at = time.monotonic()
            return False
        if self.tasks is None or self.sampled_at <= self.peers_at:   # no sample taken since
            return False
        alive = {t.pid for t in self.tasks.values()}
        return bool(self.peers - alive)

    def problem(self) -> str | None:
        self._read_steps()
        self.release_tracers()
        now, total = time.monotonic(), self.spec.total_steps
        if self.stop.after_step is not None and self.last_step >= self.stop.after_step:
            self.planned = f"stopped by the suite after it logged step {self.last_step}"
            return self.planned
        if self.stop.signal == "STOP" and self.stop.node is None and self._signal_seen():
            if self._a_peer_exited():
                self.planned = (f"a process of the job exited {now - self.signalled_at:.1f} s after one rank was "
                                "stopped (SIGSTOP): the job noticed")
                return self.planned
            if sum(step >= total for step in self.rank_steps) >= len(self.logs) - 1:
                # The others trained to the end and wait only for their launcher: no collective is
                # left that could notice the stopped rank, and the run's work is done.
                self.planned = (f"every other rank had logged its last step {now - self.signalled_at:.1f} s after one "
                                "rank was stopped (SIGSTOP): nothing left to wait for")
                return self.planned
        if self.stop.grace_s is not None and self._signal_seen() and self._grace_over(now):
            after = f"node {self.stop.node} was lost" if self.stop.node is not None else f"SIG{self.stop.signal}"
            starved = (f", not counting {self.starved_s:.1f} s its processes waited for a CPU"
                       if self.starved_s >= STARVED_NOTE_S else "")
            self.planned = (f"SIGKILLed {now - self.signalled_at:.1f} s after {after} ({GRACE_EXPIRED}: "
                            f"{self.stop.grace_s:g} s{starved})")
            if self.stop.signal == "STOP" and self.roots:   # a hang: say where everyone waited
                self.planned += "; where each process was:\n" + where(self.tree())
            return self.planned
        if self.last_step > total:
            return f"ran past CONFORMANCE_TOTAL_STEPS (logged step {self.last_step} of {total})"
        finished = all(step >= total for step in self.rank_steps)
        if now - self.start > self.limits.total_s:
            self.details = self._where_now()
            if finished:
                return (f"hung at exit: it logged its last step ({total} of {total}) but had not exited "
                        f"{self.limits.total_s:.0f} s after it started")
            return (f"did not finish {total} steps in {self.limits.total_s:.0f} s "
                    f"({f'logged up to step {self.last_step}' if self.last_step else 'logged no step'})")
        self._sample(now)
        if now - self.progress_at > self.stall_s:
            after = f"after step {self.last_step}" if self.last_step else "before logging any step"
            self.details = self._where_now() if self.roots else ""
            who = "no process under torchrun's agent" if self.spec.is_job else "no process of it"
            what = (f"made no progress for {self.stall_s:.0f} s {after} (no new step, and {who} worked, read, wrote "
                    "or waited for a CPU)") + self._stall_waits()
            return f"hung at exit: it logged its last step, then {what}" if finished else what
        for trace_file in self.trace_files:
            try:
                size = trace_file.stat().st_size
            except OSError:
                size = 0
            if size > self.limits.trace_bytes:
                return f"its strace output grew past {self.limits.trace_bytes} bytes (CONFORMANCE_TRACE_CAP)"
        return None

