"""How long a trainer process (or job) may run, and what stops it: limits, planned stops, and the
watchdog that reads the loss logs and traces as they grow, and watches the job's processes in /proc.

"No progress" does not depend on how loaded the machine is: a process that is runnable but waits
for a CPU is not hung (see `progressed`)."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

from ..model.process import ProcessResult, RunSpec, rank_log
from .attach import announced
from .proctree import (  # noqa: F401  (TaskSample, progressed: re-exported)
    TaskSample,
    kill_tree,
    process_tree,
    progressed,
    sample_tree,
    start_time,
    tracers,
)
from .where import (  # noqa: F401  (syscall_name: re-exported)
    PY_SPY_MISSING,
    environ_ranks,
    log_holders,
    py_spy,
    release_from_tracer,
    syscall_name,
    where,
)

GRACE_EXPIRED = "still running at the end of the grace period"
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
                 stop: Stop | None = None, on_signal=None):
        self.limits, self.spec, self.trace_files = limits, spec, list(trace_files)
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

    def _sample(self, now: float) -> None:
        if not self.roots or now - self.sampled_at < self.sample_s:
            return
        interval, self.sampled_at = now - self.sampled_at, now
        pids = self.tree()
        for pid in pids:
            self.seen.setdefault(pid, start_time(pid))
        tasks = sample_tree(pids, skip=frozenset(self.roots) if self.spec.is_job else frozenset())
        if self.tasks is not None and progressed(self.tasks, tasks, interval):
            self.progress_at = now
        self.tasks = tasks

    def end_leftovers(self) -> None:
        """SIGKILL every process of the run still alive (the same process: its start time has not
        changed): a rank whose agent is gone, in a session of its own, is out of its job's process
        group and tree."""
        for pid in [*self.tree(), *self.seen]:
            if pid not in self.seen or start_time(pid) == self.seen[pid]:
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
        elif not held and pids:   # a single process that keeps no log open: the innermost (strace's child)
            held = {pids[-1]: 0}
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
                    "or waited for a CPU)")
            return f"hung at exit: it logged its last step, then {what}" if finished else what
        for trace_file in self.trace_files:
            try:
                size = trace_file.stat().st_size
            except OSError:
                size = 0
            if size > self.limits.trace_bytes:
                return f"its strace output grew past {self.limits.trace_bytes} bytes (CONFORMANCE_TRACE_CAP)"
        return None

