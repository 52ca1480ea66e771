"""Start trainer processes: uninterrupted, traced, or killed at a crash point. What every runner
shares: the `Runner` protocol, how a process's strace is set up (`Tracing`), what a finished run
left (`finish`), and a traced run from start to end (`traced_run`).

A `Runner` is the only thing that launches trainers: fresh.py's `SubprocessRunner` starts a fresh
interpreter per process; warm.py's `WarmRunner` forks them from a process that imported torch
and the trainer once (forkserver.py). A spec with world_size > 1 runs as a torchrun job
(launch.py): one process per rank, each traced (or not) on its own, all stopped together.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Protocol

from ..model import evidence
from ..model.adapters import TrainerAdapter
from ..model.process import ProcessResult, RunSpec, copy_checkpoint_dir, read_job_losses, read_losses
from ..trace import recording, strace
from . import launch, nodes
from .watchdog import Limits, ProcessOverran, Stop, Watchdog

__all__ = ["Limits", "ProcessOverran", "Stop", "Watchdog", "Runner", "Tracing", "traced_run"]

POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class Tracing:
    """strace for the processes of one run: rank -> (strace argv prefix, its output file). A single
    process is rank 0; a rank of a job that is not named runs untraced."""

    ranks: dict[int, tuple[tuple[str, ...], Path]]

    @classmethod
    def each(cls, spec: RunSpec, trace_file: Path, argv_for, ranks=None) -> Tracing:
        """Every rank (or those in `ranks`) traced with `argv_for(its trace file)`; a single
        process uses `trace_file` itself, rank r of a job `<trace_file>.rank<r>`."""
        if not spec.is_job:
            return cls({0: (tuple(argv_for(trace_file)), trace_file)})
        chosen = range(spec.world_size) if ranks is None else ranks
        files = {r: trace_file.with_name(f"{trace_file.name}.rank{r}") for r in chosen}
        return cls({r: (tuple(argv_for(f)), f) for r, f in files.items()})

    def files(self) -> list[Path]:
        return [f for _, f in self.ranks.values()]


class Runner(Protocol):
    """Runs one trainer process (or job) to its end and reports what it left; raises
    ProcessOverran if it had to be stopped."""

    limits: Limits
    jobs: launch.JobConfig

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    tracing: Tracing | None = None, stop: Stop | None = None) -> ProcessResult: ...

    def fresh(self) -> Runner:
        """A runner that starts a fresh interpreter per process, with this one's limits and jobs
        (itself, if it does)."""
        ...

    def close(self) -> None: ...


def stderr_file(loss_log: Path) -> Path:
    """Where the trainer process started for `loss_log` writes its stderr (a job: its launcher; a job
    of several nodes: each agent beside it, nodes.node_stderr), beside the loss log."""
    return loss_log.with_name(loss_log.name + ".stderr")


# The end of a process's stderr a result keeps (its file keeps all of it): a trainer or a library
# that writes tens of MB there must not be held in memory whole, nor carried in every result.
STDERR_KEPT = 1 << 20


def stderr_text(path: Path, kept: int = STDERR_KEPT) -> str:
    """The stderr a process wrote to `path`: its last `kept` bytes, from the start of a line, after a
    line that says how much was left out and where all of it is ("" if there is no such file)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - kept))
            data = f.read(kept)
    except OSError:
        return ""
    if size <= kept:
        return data.decode(errors="replace")
    data = data[data.find(b"\n") + 1:] if b"\n" in data else data
    return (f"[{size - len(data)} bytes of stderr left out: all {size} are in {path}]\n"
            + data.decode(errors="replace"))


def rank_stderr_template(loss_log: Path) -> Path:
    """Where each rank of a job started for `loss_log` writes its stderr (launch.rank_stderr fills in `{rank}`)."""
    launcher = stderr_file(loss_log)
    return launcher.with_name(launcher.name + ".rank{rank}")


def _trace_text(trace_file: Path | None) -> str:
    return trace_file.read_text(errors="replace") if trace_file and trace_file.exists() else ""


def finish(rc: int, err: str, spec: RunSpec, loss_log: Path, tracing: Tracing | None, start: float,
            overrun: str | None, watch: Watchdog) -> ProcessResult:
    watch.end_leftovers()   # nothing of the run outlives it: a rank in a session of its own neither
    watch.helpers.record(tracing.files() if tracing else [])   # what its trainers left running: the evidence
    planned = overrun is not None and overrun == watch.planned
    keep_traces = not (overrun and not planned)
    if not spec.is_job:
        trace = _trace_text(tracing.ranks[0][1]) if tracing and keep_traces else ""
        losses, ranks, traces = read_losses(loss_log), (), {}
    else:
        trace = ""
        losses, ranks = read_job_losses(loss_log, spec.world_size)
        traces = {r: _trace_text(f) for r, (_, f) in tracing.ranks.items()} if tracing and keep_traces else {}
    result = ProcessResult(rc, losses, err, trace, seconds=time.monotonic() - start,
                           overrun="" if planned else overrun or "", stopped=(watch.planned or "") if planned else "",
                           rank_losses=ranks, traces=traces)
    if overrun and not planned:
        raise ProcessOverran(overrun, result, watch.details)
    crash = crash_at_exit(result, spec) if not overrun else None
    if crash:
        evidence.record(evidence.Note(
            f"a trainer process logged its last step, then died by {crash} as it exited: its run counts as "
            "finished (its checkpoints are judged as they are), but a scheduler marks such a job failed "
            "(docs/running.md, \"A crash at exit\")"))
        result = dataclasses.replace(result, returncode=0, exit_crash=crash)
    return result


# Native crashes: what an interpreter's teardown hits (torch's gloo process group is freed then, and
# its worker threads can abort the process: std::terminate), not a signal the suite or a scheduler sends.
CRASH_SIGNALS = {getattr(signal, name): name for name in ("SIGABRT", "SIGSEGV", "SIGBUS") if hasattr(signal, name)}
_TORCHRUN_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")


def crash_at_exit(result: ProcessResult, spec: RunSpec) -> str | None:
    """The signal's name when the process (every rank of a job) logged the last step of its run and
    then died by a native crash (CRASH_SIGNALS); else None. A job's ranks' exit codes are read from
    torchrun's failure report, where the ranks still exiting when one crashed show torchrun's own
    SIGTERM (-15): at least one crashed, and none failed otherwise."""
    if result.returncode == 0:
        return None
    curves = result.rank_losses if spec.is_job else (result.losses,)
    if not curves or any(max(curve, default=0) < spec.total_steps for curve in curves):
        return None
    codes = [int(c) for c in _TORCHRUN_EXIT.findall(result.stderr)] if spec.is_job else [result.returncode]
    names = {CRASH_SIGNALS.get(-c) for c in codes if not (spec.is_job and c == -signal.SIGTERM)}
    return names.pop() if codes and len(names) == 1 and None not in names else None


def job_stderr(launcher: str, template: Path, world_size: int) -> str:
    """One text from a job's stderr files: the launcher's (without its banners), then each rank's
    lines prefixed with its rank, the rank that wrote last first, so the tail shows the rank that
    failed first (the others usually fail because it did)."""
    parts = []
    ranks = []
    for r in range(world_size):
        path = launch.rank_stderr(template, r)
        try:
            text, mtime = stderr_text(path), path.stat().st_mtime
        except OSError:
            continue
        if text.strip():
            ranks.append((mtime, r, text))
    kept = [line for line in launcher.splitlines() if line.strip() and "*****" not in line
            and "OMP_NUM_THREADS" not in line]
    if kept:
        parts.append("\n".join(f"[torchrun] {line}" for line in kept))
    for _, r, text in sorted(ranks, reverse=True):
        parts.append("\n".join(f"[rank {r}] {line}" for line in text.splitlines()))
    return "\n".join(parts)


def terminal_signals() -> None:
    """Give this process the Ctrl-C disposition of a terminal's foreground process, so the trainer
    processes it starts have it too: a shell starts background jobs (`cmd &`, some CI runners and
    supervisors too) with SIGINT ignored, an exec keeps an ignored signal ignored, and Python then
    installs no KeyboardInterrupt handler, so the interrupt check's SIGINT would do nothing.
    Only from the main thread (signal.signal's rule); elsewhere it leaves things as they are."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Jobs:
    """What both runners do for a job: a free port per attempt (or the session's fixed one), and
    a new attempt when another process took the port first."""

    ATTEMPTS = 3

    jobs: launch.JobConfig

    def _with_port(self, run_once, spec: RunSpec) -> ProcessResult:
        for attempt in range(self.ATTEMPTS):
            port = self.jobs.port or launch.free_port()
            result = run_once(port)
            retry = (result.returncode != 0 and not any(result.rank_losses) and launch.port_in_use(result.stderr)
                     and self.jobs.port is None and attempt + 1 < self.ATTEMPTS)
            if not retry:
                return result
        return result


def run_nodes(limits: Limits, spec: RunSpec, loss_log: Path, ckpt_dir: Path, tracing: Tracing | None,
              stop: Stop | None, template: Path, make_agent, problem=None, watch: Watchdog | None = None) -> ProcessResult:
    """A job of several nodes (nodes.py), by either runner: `make_agent(stderr path, watchdog)`
    runs one node's agent (its environment with the run's mark: Watchdog.env)."""
    stderr_path = stderr_file(loss_log)
    start = time.monotonic()
    job: list[nodes.NodeJob] = []
    watch = watch or Watchdog(limits, spec, loss_log, tracing.files() if tracing else [], stop, ckpt_dir=ckpt_dir)
    watch.on_signal = lambda signum: job[0].on_signal(signum)
    job.append(nodes.NodeJob(spec, watch, POLL_S))
    rc, overrun = job[0].run(make_agent(stderr_path, watch), problem)
    err = job_stderr(nodes.agents_stderr(stderr_path, spec.nnodes), template, spec.world_size)
    return finish(rc, err, spec, loss_log, tracing, start, overrun, watch)


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def listing(directory: Path) -> frozenset[str]:
    """Every path under `directory`, relative to it."""
    return frozenset(p.relative_to(directory).as_posix() for p in directory.rglob("*"))


def traced_run(runner: Runner, adapter: TrainerAdapter, spec: RunSpec, workdir: Path, *, tag: str = "baseline",
               prepare: Path | None = None, data: bool = False, trace: bool = True) -> recording.RecordedRun:
    """Run uninterrupted under strace (every rank of a job): with `data`, a recording crash states
    can be rebuilt from. `prepare` is a checkpoint directory to start from (copied). Without
    `trace` (strace unusable here), the run's losses only: no operations."""
    ckpt = (workdir / f"{tag}-ckpt").resolve()
    if ckpt.exists():
        shutil.rmtree(ckpt)
    if prepare is not None:
        copy_checkpoint_dir(prepare, ckpt, spec.cold)
    else:
        ckpt.mkdir(parents=True)
    before = listing(ckpt)
    log = (workdir / f"{tag}-loss.jsonl").resolve()
    log.unlink(missing_ok=True)
    tracing = Tracing.each(spec, workdir / f"{tag}.strace", lambda f: strace.record_argv(f, data=data)) \
        if trace else None
    result = runner.run_process(adapter, spec, ckpt, log, tracing=tracing)
    run = recording.from_result(result, spec, ckpt, log, preexisting=before)
    for f in tracing.files() if tracing else ():
        f.unlink(missing_ok=True)
    return run
