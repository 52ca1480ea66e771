"""Multi-node jobs: N torchrun agents on this machine, one per "node" (launch.py), run, watched and
stopped as one job, by either runner.

Each agent runs on a thread of its own (a fresh torchrun, or one forked from the warm fork
server), while this thread asks the job's one Watchdog what to do. Nodes fail the way machines
do: a node that loses a rank stops its own ranks and exits, and the other nodes go on until they
notice at their next collective; nothing here stops them early. Losing a node (a node point) is
different: its agent and every rank on it are SIGKILLed at once, the agent first so it cannot
react (a SIGTERM to its ranks would let them run handlers no dead machine runs); the tracers are
spared, so their traces end with the kill.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..model.process import RunSpec
from . import launch, proctree
from .proctree import comm, process_tree
from .watchdog import Watchdog
from .zygote import ZYGOTE_COMM

# How long a node's agent thread may take to end once its agent has exited or been SIGKILLed.
AGENT_EXIT_S = 60.0
# An agent's thread asks this every poll: why its node must stop now (None: go on).
ShouldStop = Callable[[], str | None]
# Runs node k's agent to its end: (k, should_stop, started(pid)) -> exit status.
RunAgent = Callable[[int, ShouldStop, Callable[[int], None]], int]


@dataclasses.dataclass
class Node:
    index: int
    pid: int | None = None
    returncode: int | None = None
    lost: bool = False
    after_peer: bool = False    # stopped by the suite once another node had failed and it had no rank left


def ranks_left(pid: int) -> bool:
    """Whether a process (a node's agent) still has a process under it other than a tracer or a
    warm job's rank zygote (which waits for requests as long as the agent lives)."""
    return sum(comm(p) not in ("", "strace", ZYGOTE_COMM) for p in process_tree(pid)) > 1


def kill_tree(pid: int) -> None:
    """A node lost whole: SIGKILL `pid` and every process below it but strace (which then reports
    its tracee's death and exits)."""
    proctree.kill_tree(pid, spare_tracers=True)


class NodeJob:
    """One multi-node job: its nodes, why it was stopped, and which node was lost."""

    def __init__(self, spec: RunSpec, watch: Watchdog, poll: float):
        self.spec = spec
        self.nodes = [Node(k) for k in range(spec.nnodes)]
        self.watch, self.poll = watch, poll
        self.stop_reason: str | None = None
        self._lock = threading.Lock()

    def _started(self, k: int) -> Callable[[int], None]:
        def started(pid: int) -> None:
            with self._lock:
                self.nodes[k].pid = pid
                self.watch.follow(pid)
        return started

    def _should_stop(self, k: int) -> ShouldStop:
        return lambda: self.stop_reason or (f"node {k} was lost" if self.nodes[k].lost else None)

    def lose(self, k: int) -> None:
        """Take node k down whole: its agent and ranks, at once (a node point)."""
        with self._lock:
            node = self.nodes[k]
            node.lost = True
            if node.pid is not None:
                kill_tree(node.pid)

    def signal_all(self, signum: int) -> None:
        """Send `signum` to every agent's process group (a scheduler's SIGTERM, a terminal's SIGINT)."""
        for node in self.nodes:
            if node.pid is not None:
                try:
                    os.killpg(node.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def on_signal(self, signum: int) -> None:
        """The Watchdog's on_signal: a node point's SIGSTOP takes its node down; any other signal
        goes to the whole job."""
        node = self.watch.stop.node
        if signum == signal.SIGSTOP and node is not None and node < len(self.nodes):
            self.lose(node)
        elif signum != signal.SIGSTOP:
            self.signal_all(signum)

    def _end_after_a_failed_node(self) -> None:
        """Once a node's agent has exited non-zero, an agent with no rank left can only be waiting
        in torchrun's exit barrier for it (up to 300 s; it never comes): the job is over, as a
        scheduler would find, so such agents are stopped now. Not with restarts in place, where an
        agent without ranks may be starting new ones."""
        if self.spec.max_restarts or not any(n.returncode not in (None, 0) and not n.lost and not n.after_peer
                                             for n in self.nodes):
            return
        with self._lock:
            for node in self.nodes:
                if node.returncode is None and node.pid is not None and not node.lost and not ranks_left(node.pid):
                    node.after_peer = True
                    kill_tree(node.pid)

    def run(self, run_agent: RunAgent, problem: Callable[[], str | None] | None = None) -> tuple[int, str | None]:
        """Start every node's agent, watch the job until all have exited, and return (the job's
        exit status, why the suite stopped it or None). The status is the first non-zero status
        of a node that was not lost or stopped after another failed, else the lost node's, else 0."""
        def body(k: int) -> None:
            try:
                self.nodes[k].returncode = run_agent(k, self._should_stop(k), self._started(k))
            except BaseException:
                self.nodes[k].returncode = -1
                self.stop_reason = self.stop_reason or f"node {k}'s agent could not be run"
                raise

        threads = [threading.Thread(target=body, args=(k,), daemon=True, name=f"node{k}") for k in
                   range(len(self.nodes))]
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads):
                self._end_after_a_failed_node()
                if self.stop_reason is None:
                    why = (problem and problem()) or self.watch.problem()
                    if why:
                        self.stop_reason = why
                        for node in self.nodes:
                            if node.pid is not None:
                                kill_tree(node.pid)
                time.sleep(self.poll)
        finally:
            if any(t.is_alive() for t in threads):   # the watch above failed: stop the agents it left
                for node in self.nodes:
                    if node.pid is not None:
                        kill_tree(node.pid)
            for t in threads:
                t.join(AGENT_EXIT_S)
            stuck = [t.name for t in threads if t.is_alive()]
            if stuck:
                raise RuntimeError(f"the suite's threads running the agents of {', '.join(stuck)} had not ended "
                                   f"{AGENT_EXIT_S:g} s after the job was over")
        codes = [n.returncode if n.returncode is not None else -1 for n in self.nodes]
        kept = [c for n, c in zip(self.nodes, codes) if c and not n.lost and not n.after_peer]
        lost = [c for n, c in zip(self.nodes, codes) if n.lost]
        return (kept[0] if kept else lost[0] if lost else 0), self.stop_reason


def node_stderr(template: Path, k: int) -> Path:
    """Where node k's agent writes its stderr."""
    return template.with_name(f"{template.name}.node{k}")


def agents_stderr(stderr_path: Path, nnodes: int) -> str:
    """Every agent's stderr, each line prefixed with its node."""
    lines = []
    for k in range(nnodes):
        try:
            text = node_stderr(stderr_path, k).read_text(errors="replace")
        except OSError:
            continue
        lines += [f"node {k}: {line}" for line in text.splitlines()]
    return "\n".join(lines)


def fresh_agent(trainer_argv: tuple[str, ...], spec: RunSpec, env_for: Callable[[int], dict[str, str]], port: int,
                stderr_path: Path, poll: float) -> RunAgent:
    """Node k's agent as a fresh `python -m torch.distributed.run` (its ranks: fresh interpreters),
    with `env_for(k)` as its environment."""
    def run(k: int, should_stop: ShouldStop, started: Callable[[int], None]) -> int:
        argv = launch.fresh_argv(trainer_argv, spec, port, k, logs=launch.log_dir(stderr_path))
        with open(node_stderr(stderr_path, k), "wb") as err:
            proc = subprocess.Popen(argv, env=env_for(k), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
            started(proc.pid)
            while proc.poll() is None:
                if should_stop():
                    kill_tree(proc.pid)
                    proctree.reap(proc, proctree.KILLED_EXIT_S, f"node {k}'s torchrun agent, SIGKILLed by the suite,")
                    break
                time.sleep(poll)
        return proc.returncode
    return run


def warm_agent(server, target, spec: RunSpec, env_for: Callable[[int], dict[str, str]], port: int, stderr_path: Path,
               poll: float) -> RunAgent:
    """Node k's agent forked from the warm fork server (its ranks forked from it, see rank.py),
    with `env_for(k)` as its environment."""
    def run(k: int, should_stop: ShouldStop, started: Callable[[int], None]) -> int:
        status, _ = server.run(target.target, list(target.argv), env_for(k), node_stderr(stderr_path, k), started,
                               watch=should_stop, poll=poll, kind=target.kind,
                               job=launch.torchrun_flags(spec, port, k, logs=launch.log_dir(stderr_path)))
        return status
    return run
