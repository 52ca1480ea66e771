"""Start trainer processes: uninterrupted, traced, or killed at a crash point.

A `Runner` is the only thing that launches trainers. `SubprocessRunner` starts a fresh interpreter
per process; `WarmRunner` forks them from a process that imported torch and the trainer once
(forkserver.py), for `python -m module` and `python train.py` trainers whose interpreter imports
the suite's torch. A spec with world_size > 1 runs as a torchrun job (launch.py): one process per
rank, each traced (or not) on its own, all stopped together.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Protocol

from ..model.adapters import TrainerAdapter
from ..model.process import ProcessResult, RunSpec, copy_checkpoint_dir, read_job_losses, read_losses
from ..trace import recording, strace
from . import launch, nodes
from .attach import RankAttacher, attach_strace
from .watchdog import Limits, ProcessOverran, Stop, Watchdog

__all__ = ["Limits", "ProcessOverran", "Stop", "Watchdog", "Runner", "SubprocessRunner", "WarmRunner", "Tracing",
           "traced_run"]

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

    def close(self) -> None: ...


def _trace_text(trace_file: Path | None) -> str:
    return trace_file.read_text(errors="replace") if trace_file and trace_file.exists() else ""


def _finish(rc: int, err: str, spec: RunSpec, loss_log: Path, tracing: Tracing | None, start: float,
            overrun: str | None, watch: Watchdog) -> ProcessResult:
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
        raise ProcessOverran(overrun, result)
    return result


def _job_stderr(launcher: str, template: Path, world_size: int) -> str:
    """One text from a job's stderr files: the launcher's (without its banners), then each rank's
    lines prefixed with its rank, the rank that wrote last first, so the tail shows the rank that
    failed first (the others usually fail because it did)."""
    parts = []
    ranks = []
    for r in range(world_size):
        path = launch.rank_stderr(template, r)
        try:
            text, mtime = path.read_text(errors="replace"), path.stat().st_mtime
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


class _Jobs:
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


class SubprocessRunner(_Jobs):
    """One fresh interpreter per trainer process (a job: the torchrun program)."""

    def __init__(self, limits: Limits | None = None, jobs: launch.JobConfig | None = None):
        terminal_signals()
        self.limits = limits or Limits()
        self.jobs = jobs or launch.JobConfig()

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    tracing: Tracing | None = None, stop: Stop | None = None) -> ProcessResult:
        if spec.is_job:
            return self._with_port(lambda port: self._run(adapter, spec, ckpt_dir, loss_log, tracing, stop, port),
                                   spec)
        return self._run(adapter, spec, ckpt_dir, loss_log, tracing, stop, None)

    def _run(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path,
             tracing: Tracing | None, stop: Stop | None, port: int | None) -> ProcessResult:
        env = adapter.environment(spec.env(ckpt_dir, loss_log))
        template = loss_log.with_name(loss_log.name + ".stderr.rank{rank}")
        err_path = loss_log.with_name(loss_log.name + ".stderr")
        if port is not None and spec.nnodes > 1:
            env = launch.rank_env(env, spec, stderr_template=template,
                                  straces={r: list(p) for r, (p, _) in (tracing.ranks.items() if tracing else ())})
            return _run_nodes(self.limits, spec, loss_log, tracing, stop, template,
                              lambda err: nodes.fresh_agent(tuple(adapter.argv), spec,
                                                            lambda k: spec.node_env(env, ckpt_dir, k), port, err, POLL_S))
        if port is None:
            argv = list(tracing.ranks[0][0] if tracing else ()) + list(adapter.argv)
        else:
            argv = launch.fresh_argv(adapter.argv, spec, port, logs=launch.log_dir(err_path))
            env = launch.rank_env(env, spec, stderr_template=template,
                                  straces={r: list(p) for r, (p, _) in (tracing.ranks.items() if tracing else ())})
        start = time.monotonic()
        proc_box: list[subprocess.Popen] = []

        def signal_job(signum: int) -> None:
            if proc_box:
                _signal_group(proc_box[0].pid, signum)

        watch = Watchdog(self.limits, spec, loss_log, tracing.files() if tracing else [], stop,
                         on_signal=signal_job if port is not None else None)
        with open(err_path, "w+b") as err_file:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err_file, start_new_session=True)
            proc_box.append(proc)
            watch.follow(proc.pid)
            overrun = None
            while proc.poll() is None:
                overrun = watch.problem()
                if overrun:
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
                time.sleep(POLL_S)
            if port is not None:
                _signal_group(proc.pid, signal.SIGKILL)   # no rank outlives its job
            err_file.seek(0)
            err = err_file.read().decode(errors="replace")
        if port is not None:
            err = _job_stderr(err, template, spec.world_size)
        return _finish(proc.returncode, err, spec, loss_log, tracing, start, overrun, watch)

    def close(self) -> None:
        pass


class WarmRunner(_Jobs):
    """Forks trainer processes from a warm process that has imported torch and the trainer's
    module once (see forkserver.py); a job's agent is forked the same way and forks its ranks.
    Trainers the server cannot run (another interpreter, a shell wrapper) fall back to a fresh
    interpreter."""

    def __init__(self, limits: Limits | None = None, jobs: launch.JobConfig | None = None):
        terminal_signals()
        self._servers: dict = {}
        self.jobs = jobs or launch.JobConfig()
        self._fallback = SubprocessRunner(jobs=self.jobs)
        self._lock = threading.Lock()
        self.limits = limits or Limits()

    def _server(self, adapter: TrainerAdapter, target, *, job: bool = False):
        from .forkserver import JOB_PRELOAD, ForkServer
        with self._lock:
            key = (target.interpreter, target.kind, target.target, adapter.pythonpath, job)
            if key not in self._servers:
                preload = [target.target] if target.kind == "module" else script_imports(target.target)
                self._servers[key] = ForkServer(preload + (JOB_PRELOAD if job else []),
                                                env=adapter.environment(dict(os.environ)),
                                                interpreter=target.interpreter)
            return self._servers[key]

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    tracing: Tracing | None = None, stop: Stop | None = None) -> ProcessResult:
        from .forkserver import warm_target
        target, _ = warm_target(adapter)
        if target is None:
            self._fallback.limits, self._fallback.jobs = self.limits, self.jobs
            return self._fallback.run_process(adapter, spec, ckpt_dir, loss_log, tracing=tracing, stop=stop)
        if spec.is_job:
            return self._with_port(lambda port: self._run_job(adapter, target, spec, ckpt_dir, loss_log, tracing,
                                                              stop, port), spec)
        stderr_path = loss_log.with_name(loss_log.name + ".stderr")
        start = time.monotonic()
        watch = Watchdog(self.limits, spec, loss_log, tracing.files() if tracing else [], stop)

        def attach(pid: int) -> subprocess.Popen | None:
            watch.follow(pid)
            return attach_strace(list(tracing.ranks[0][0]), pid) if tracing else None

        rc, overrun = self._server(adapter, target).run(target.target, list(target.argv),
                                                        adapter.environment(spec.env(ckpt_dir, loss_log)),
                                                        stderr_path, attach, watch=watch.problem, poll=POLL_S,
                                                        kind=target.kind)
        err = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
        return _finish(rc, err, spec, loss_log, tracing, start, overrun, watch)

    def _run_job(self, adapter: TrainerAdapter, target, spec: RunSpec, ckpt_dir: Path, loss_log: Path,
                 tracing: Tracing | None, stop: Stop | None, port: int) -> ProcessResult:
        stderr_path = loss_log.with_name(loss_log.name + ".stderr")
        template = loss_log.with_name(loss_log.name + ".stderr.rank{rank}")
        announce = Path(tempfile.mkdtemp(prefix="ranks-", dir=loss_log.parent))
        straces = {r: list(p) for r, (p, _) in (tracing.ranks.items() if tracing else ())}
        env = launch.rank_env(adapter.environment(spec.env(ckpt_dir, loss_log)), spec, stderr_template=template,
                              straces=straces, announce=announce)
        attacher = RankAttacher(announce, straces)
        if spec.nnodes > 1:
            server = self._server(adapter, target, job=True)
            try:
                attacher.start()
                return _run_nodes(self.limits, spec, loss_log, tracing, stop, template,
                                  lambda err: nodes.warm_agent(server, target, spec,
                                                               lambda k: spec.node_env(env, ckpt_dir, k), port, err,
                                                               POLL_S),
                                  problem=attacher.problem)
            finally:
                attacher.close()
                shutil.rmtree(announce, ignore_errors=True)
        job_pid: list[int] = []

        def attach(pid: int):
            job_pid.append(pid)
            watch.follow(pid)
            return attacher.start()

        start = time.monotonic()
        watch = Watchdog(self.limits, spec, loss_log, tracing.files() if tracing else [], stop,
                         on_signal=lambda signum: _signal_group(job_pid[0], signum) if job_pid else None)
        def problem() -> str | None:
            return attacher.problem() or watch.problem()

        try:
            rc, overrun = self._server(adapter, target, job=True).run(
                target.target, list(target.argv), env, stderr_path, attach, watch=problem, poll=POLL_S,
                kind=target.kind, job=launch.torchrun_flags(spec, port, logs=launch.log_dir(stderr_path)))
        finally:
            attacher.close()
            shutil.rmtree(announce, ignore_errors=True)
        err = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
        return _finish(rc, _job_stderr(err, template, spec.world_size), spec, loss_log, tracing, start, overrun,
                       watch)

    def run_twice(self, adapter: TrainerAdapter, first: RunSpec, second: RunSpec, ckpt_dir: Path,
                  first_log: Path, second_log: Path) -> ProcessResult | None:
        """Run the trainer with `first`, then again with `second` in the same process (only for
        single-process trainers the fork server runs); the second run's result, or None if not
        possible."""
        from .forkserver import warm_target
        target, _ = warm_target(adapter)
        if target is None or first.is_job:
            return None
        stderr_path = second_log.with_name(second_log.name + ".stderr")
        start = time.monotonic()
        watch = Watchdog(dataclasses.replace(self.limits, stall_s=self.limits.total_s), second, second_log, [])
        rc, overrun = self._server(adapter, target).run(
            target.target, list(target.argv), adapter.environment(first.env(ckpt_dir, first_log)), stderr_path,
            watch.follow, watch=watch.problem, poll=POLL_S,
            then_env=adapter.environment(second.env(ckpt_dir, second_log)),
            kind=target.kind)
        err = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
        return _finish(rc, err, second, second_log, None, start, overrun, watch)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()


def _run_nodes(limits: Limits, spec: RunSpec, loss_log: Path, tracing: Tracing | None, stop: Stop | None,
               template: Path, make_agent, problem=None) -> ProcessResult:
    """A job of several nodes (nodes.py), by either runner: `make_agent(stderr path)` runs one
    node's agent."""
    stderr_path = loss_log.with_name(loss_log.name + ".stderr")
    start = time.monotonic()
    job: list[nodes.NodeJob] = []
    watch = Watchdog(limits, spec, loss_log, tracing.files() if tracing else [], stop,
                     on_signal=lambda signum: job[0].on_signal(signum))
    job.append(nodes.NodeJob(spec, watch, POLL_S))
    rc, overrun = job[0].run(make_agent(stderr_path), problem)
    err = _job_stderr(nodes.agents_stderr(stderr_path, spec.nnodes), template, spec.world_size)
    return _finish(rc, err, spec, loss_log, tracing, start, overrun, watch)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def script_imports(path: str) -> list[str]:
    """The modules a script imports at its top level: the fork server imports them once, as it
    imports a module trainer, so a forked child does not (a failing import is left to the child)."""
    import ast
    try:
        tree = ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return list(dict.fromkeys(names))


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
