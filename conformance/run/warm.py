"""The warm runner: trainer processes forked from a server that imported torch and the trainer's
module once (forkserver.py, through forkclient.py), two servers per trainer for two process
identities (identity.py); a job's agent is forked the same way and forks its ranks (rank.py)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..model.adapters import TrainerAdapter
from ..model.process import ProcessResult, RunSpec
from . import launch, nodes, runners
from .attach import RankAttacher, Tracer, attach_strace
from .fresh import SubprocessRunner
from .guardian import guard
from .identity import Identities, hash_seeds
from .proctree import kill_tree, process_tree, start_time
from .runners import POLL_S, Jobs, Tracing, finish, job_stderr, run_nodes, signal_group, terminal_signals
from .watchdog import Limits, Stop, Watchdog


class WarmRunner(Jobs):
    """Forks trainer processes from a warm process that has imported torch and the trainer's
    module once (see forkserver.py); a job's agent is forked the same way and forks its ranks.
    Each trainer has two such servers with different process identities (identity.py): a process
    that resumes runs on the other one than the process that saved. Trainers the server cannot run
    (another interpreter, a shell wrapper, a module that starts a thread at import) and machines
    where strace cannot attach to a running process (attach.attach_problem) get a fresh
    interpreter per process instead."""

    def __init__(self, limits: Limits | None = None, jobs: launch.JobConfig | None = None):
        from .forkclient import roots
        terminal_signals()
        guard()
        self._servers: dict = {}
        self.jobs = jobs or launch.JobConfig()
        self._fallback = SubprocessRunner(jobs=self.jobs)
        self._lock = threading.Lock()
        self.limits = limits or Limits()
        self.identities = Identities(hash_seeds(os.environ, [seed for _, seed in roots() if seed]))
        self.refused: dict[str, str] = {}   # trainer spec -> why its server cannot fork (it runs fresh)

    def fresh(self) -> SubprocessRunner:
        """A runner of fresh interpreters with this one's limits and jobs."""
        self._fallback.limits, self._fallback.jobs = self.limits, self.jobs
        return self._fallback

    def _server(self, adapter: TrainerAdapter, target, identity: int, *, job: bool = False):
        from .forkclient import ForkServer
        from .forkserver import JOB_PRELOAD
        with self._lock:
            key = (target.interpreter, target.kind, target.target, adapter.pythonpath, job, identity)
            if key not in self._servers:
                preload = [target.target] if target.kind == "module" else script_imports(target.target)
                env = self.identities.server_env(adapter.environment(dict(os.environ)), identity)
                self._servers[key] = ForkServer(preload, later=JOB_PRELOAD if job else [], env=env,
                                                interpreter=target.interpreter)
            return self._servers[key]

    def runs_fresh(self, adapter: TrainerAdapter) -> bool:
        """Whether this runner starts `adapter`'s processes in fresh interpreters (its command is
        not a Python module or script of this torch, strace may not attach to a fork, or its server
        refused or failed its warm-up): then its failures need no confirmation in a fresh one."""
        from .forkserver import warm_target
        return warm_target(adapter)[0] is None or adapter.spec in self.refused or _attach_refused(adapter)

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    tracing: Tracing | None = None, stop: Stop | None = None) -> ProcessResult:
        from .forkclient import ServerRefused
        from .forkserver import warm_target
        target, _ = warm_target(adapter)
        if self.runs_fresh(adapter):
            return self.fresh().run_process(adapter, spec, ckpt_dir, loss_log, tracing=tracing, stop=stop)
        identity = self.identities.choose(ckpt_dir)
        try:
            if spec.is_job:
                return self._with_port(lambda port: self._run_job(adapter, target, identity, spec, ckpt_dir, loss_log,
                                                                  tracing, stop, port), spec)
            return self._run_single(adapter, target, identity, spec, ckpt_dir, loss_log, tracing, stop)
        except ServerRefused as exc:
            self.refused[adapter.spec] = str(exc)
            print(f"conformance: {adapter.name} runs in a fresh interpreter per process: {exc}", file=sys.stderr)
            return self.fresh().run_process(adapter, spec, ckpt_dir, loss_log, tracing=tracing, stop=stop)

    def _run_single(self, adapter: TrainerAdapter, target, identity: int, spec: RunSpec, ckpt_dir: Path,
                    loss_log: Path, tracing: Tracing | None, stop: Stop | None) -> ProcessResult:
        stderr_path = runners.stderr_file(loss_log)
        start = time.monotonic()
        watch = Watchdog(self.limits, spec, loss_log, tracing.files() if tracing else [], stop, ckpt_dir=ckpt_dir)

        def attach(pid: int) -> Tracer | None:
            watch.follow(pid)
            return attach_strace(list(tracing.ranks[0][0]), pid, on_left=_helpers_of(watch)) if tracing else None

        rc, overrun = self._server(adapter, target, identity).run(
            target.target, list(target.argv), watch.env(adapter.environment(spec.env(ckpt_dir, loss_log))), stderr_path,
            attach, watch=watch.problem, poll=POLL_S, kind=target.kind)
        return finish(rc, runners.stderr_text(stderr_path), spec, loss_log, tracing, start, overrun, watch)

    def _run_job(self, adapter: TrainerAdapter, target, identity: int, spec: RunSpec, ckpt_dir: Path,
                 loss_log: Path, tracing: Tracing | None, stop: Stop | None, port: int) -> ProcessResult:
        stderr_path, template = runners.stderr_file(loss_log), runners.rank_stderr_template(loss_log)
        announce = Path(tempfile.mkdtemp(prefix="ranks-", dir=loss_log.parent))
        straces = {r: list(p) for r, (p, _) in (tracing.ranks.items() if tracing else ())}
        job_pid: list[int] = []
        watch = Watchdog(self.limits, spec, loss_log, tracing.files() if tracing else [], stop,
                         on_signal=lambda signum: signal_group(job_pid[0], signum) if job_pid else None,
                         ckpt_dir=ckpt_dir)
        watch.announced = announce
        env = watch.env(launch.rank_env(adapter.environment(spec.env(ckpt_dir, loss_log)), spec,
                                        stderr_template=template, straces=straces, announce=announce))
        attacher = RankAttacher(announce, straces, on_left=_helpers_of(watch))
        if spec.nnodes > 1:
            server = self._server(adapter, target, identity, job=True)
            try:
                attacher.start()
                return run_nodes(self.limits, spec, loss_log, ckpt_dir, tracing, stop, template,
                                  lambda err, _: nodes.warm_agent(server, target, spec,
                                                                  lambda k: spec.node_env(env, ckpt_dir, k), port, err,
                                                                  POLL_S),
                                  problem=attacher.problem, watch=watch)
            finally:
                attacher.close()
                shutil.rmtree(announce, ignore_errors=True)

        def attach(pid: int):
            job_pid.append(pid)
            watch.follow(pid)
            return attacher.start()

        start = time.monotonic()

        def problem() -> str | None:
            return attacher.problem() or watch.problem()

        try:
            rc, overrun = self._server(adapter, target, identity, job=True).run(
                target.target, list(target.argv), env, stderr_path, attach, watch=problem, poll=POLL_S,
                kind=target.kind, job=launch.torchrun_flags(spec, port, logs=launch.log_dir(stderr_path)))
        finally:
            attacher.close()
            shutil.rmtree(announce, ignore_errors=True)
        return finish(rc, job_stderr(runners.stderr_text(stderr_path), template, spec.world_size), spec, loss_log,
                       tracing, start, overrun, watch)

    def run_twice(self, adapter: TrainerAdapter, first: RunSpec, second: RunSpec, ckpt_dir: Path,
                  first_log: Path, second_log: Path) -> ProcessResult | None:
        """Run the trainer with `first`, then again with `second` in the same process (only for
        single-process trainers the fork server runs); the second run's result, or None if not
        possible."""
        from .forkserver import warm_target
        target, _ = warm_target(adapter)
        if target is None or first.is_job:
            return None
        stderr_path = runners.stderr_file(second_log)
        start = time.monotonic()
        watch = Watchdog(dataclasses.replace(self.limits, stall_s=self.limits.total_s), second, second_log, [],
                         ckpt_dir=ckpt_dir)
        rc, overrun = self._server(adapter, target, self.identities.choose(ckpt_dir)).run(
            target.target, list(target.argv), watch.env(adapter.environment(first.env(ckpt_dir, first_log))),
            stderr_path, watch.follow, watch=watch.problem, poll=POLL_S,
            then_env=watch.env(adapter.environment(second.env(ckpt_dir, second_log))),
            kind=target.kind)
        return finish(rc, runners.stderr_text(stderr_path), second, second_log, None, start, overrun, watch)

    def close(self) -> None:
        """Close every server, and end what their imports of the trainer's modules started and left
        running (a helper a module starts at import runs in the server too): each server ends its
        own children, not a process they left."""
        for server in self._servers.values():
            pid = server.proc.pid
            left = {p: start_time(p) for p in process_tree(pid) if p != pid}
            server.close()
            for p, started in left.items():
                if start_time(p) == started:
                    kill_tree(p)
        self._servers.clear()


def _helpers_of(watch: Watchdog):
    """What a warm run's strace still follows once the process it attached to has exited: helpers
    that process left running, ended by the run's watchdog (nothing else of the run runs then)."""
    def end(left: list[int]) -> None:
        watch.helpers.end(left, alone=True)
    return end


def _attach_refused(adapter: TrainerAdapter) -> bool:
    """Whether strace works here but cannot attach to a running process (attach.attach_problem):
    then the warm runner, whose tracing attaches, runs every process fresh, as --runner=fresh."""
    from ..trace.strace import strace_problem
    from .attach import attach_problem
    return adapter.has("syscall_crash") and strace_problem() is None and attach_problem() is not None


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
