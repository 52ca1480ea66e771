"""The fresh runner: one new interpreter per trainer process (a job: the torchrun program), as a
team's own launch starts them. The warm runner (warm.py) stands in for it, and falls back to it."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from ..model.adapters import TrainerAdapter
from ..model.process import ProcessResult, RunSpec
from . import launch, nodes, runners
from .guardian import guard
from .proctree import KILLED_EXIT_S, kill_tree, reap
from .runners import POLL_S, Jobs, Tracing, finish, job_stderr, run_nodes, signal_group, terminal_signals
from .watchdog import Limits, Stop, Watchdog


class SubprocessRunner(Jobs):
    """One fresh interpreter per trainer process (a job: the torchrun program)."""

    def __init__(self, limits: Limits | None = None, jobs: launch.JobConfig | None = None):
        terminal_signals()
        guard()   # its processes run in sessions of their own: they end with this one through the guardian
        self.limits = limits or Limits()
        self.jobs = jobs or launch.JobConfig()

    def fresh(self) -> SubprocessRunner:
        return self

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    tracing: Tracing | None = None, stop: Stop | None = None) -> ProcessResult:
        if spec.is_job:
            return self._with_port(lambda port: self._run(adapter, spec, ckpt_dir, loss_log, tracing, stop, port),
                                   spec)
        return self._run(adapter, spec, ckpt_dir, loss_log, tracing, stop, None)

    def _run(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path,
             tracing: Tracing | None, stop: Stop | None, port: int | None) -> ProcessResult:
        env = adapter.environment(spec.env(ckpt_dir, loss_log))
        template, err_path = runners.rank_stderr_template(loss_log), runners.stderr_file(loss_log)
        if port is not None and spec.nnodes > 1:
            env = launch.rank_env(env, spec, stderr_template=template,
                                  straces={r: list(p) for r, (p, _) in (tracing.ranks.items() if tracing else ())})
            return run_nodes(self.limits, spec, loss_log, ckpt_dir, tracing, stop, template,
                              lambda err, watch: nodes.fresh_agent(tuple(adapter.argv), spec,
                                                                   lambda k: watch.env(spec.node_env(env, ckpt_dir, k)),
                                                                   port, err, POLL_S))
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
                signal_group(proc_box[0].pid, signum)

        watch = Watchdog(self.limits, spec, loss_log, tracing.files() if tracing else [], stop,
                         on_signal=signal_job if port is not None else None, ckpt_dir=ckpt_dir)
        with open(err_path, "wb") as err_file:
            proc = subprocess.Popen(argv, env=watch.env(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err_file, start_new_session=True)
        proc_box.append(proc)
        watch.follow(proc.pid)
        overrun = None
        while proc.poll() is None:
            overrun = watch.problem()
            if overrun:
                kill_tree(proc.pid)   # read while it still has its children: ranks in sessions of their own too
                reap(proc, KILLED_EXIT_S, "the trainer process the suite had just SIGKILLed")
                break
            time.sleep(POLL_S)
        err = runners.stderr_text(err_path)
        if port is not None:
            err = job_stderr(err, template, spec.world_size)
        return finish(proc.returncode, err, spec, loss_log, tracing, start, overrun, watch)

    def close(self) -> None:
        pass
