"""Multi-rank jobs, started by torchrun: the one owner of the launcher's command line.

A trainer with world size W > 1 runs as

    torchrun --nnodes=1 --nproc-per-node=W --max-restarts=0 --monitor-interval=0.005 \
             --log-dir=<in the run's directory> \
             --rdzv-backend=static --master-addr=127.0.0.1 --master-port=<a free port> <trainer>

one node, one local rendezvous (what `--standalone` gives), on a port chosen per job so that
`pytest -n auto` never collides; with `--max-restarts=0` a rank that dies makes torchrun's agent
stop the others (SIGTERM, then SIGKILL) and exit non-zero, as a production job does. Every rank
gets the suite's CONFORMANCE_* variables; torchrun sets RANK, LOCAL_RANK and WORLD_SIZE.

A job of N > 1 nodes (`--nnodes`) runs as N agents on this machine, each

    torchrun --nnodes=N --nproc-per-node=W/N --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:<port> \
             --rdzv-id=<one per job> --local-addr=127.0.<10+k>.1 ...

meeting through c10d rendezvous, as agents on N machines do. The rendezvous numbers its nodes
(GROUP_RANK) in the order of their addresses, so a distinct loopback address per agent makes the
suite's node k torchrun's node k, and its ranks k*W/N .. (k+1)*W/N-1, in every run: crash points
name ranks and nodes, and must replay. Each agent is its own process group; losing node k stops
its agent and ranks together (nodes.py).

Two ways to run the same launcher:
- fresh: torchrun as `python -m torch.distributed.run` (this interpreter's: no PATH lookup, so an
  environment that is not activated works), with `python -m conformance.run.rank` as the entry point of every
  rank (`--no-python`): it sends the rank's stderr to its own file and execs the trainer's
  command, under strace when the suite traces that rank;
- warm: torchrun's own argument parser and `elastic_launch` (what the `torchrun` program calls),
  run in a process forked from the suite's warm fork server, with a function entry point and
  `--start-method=fork`: ranks are forked with torch and the trainer already imported, and
  strace attaches to a rank before it runs (rank.py).
"""
from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

from ..model.process import RunSpec

# The agent checks on its ranks this often: how soon a rank's death stops the others.
MONITOR_INTERVAL_S = 0.005
# Variables the rank entry point reads (and removes before the trainer runs).
STRACE_VAR = "CONFORMANCE_RANK_STRACE"      # JSON {rank: strace argv prefix}
STDERR_VAR = "CONFORMANCE_RANK_STDERR"      # a path with "{rank}" in it
ANNOUNCE_VAR = "CONFORMANCE_RANK_ANNOUNCE"  # warm: directory where a traced rank announces its pid
TRACER_VAR = "CONFORMANCE_RANK_TRACER"      # warm: the suite's pid, whose strace may attach to the rank
# How long an agent waits for the others to join the rendezvous (torchrun's default: 600 s).
JOIN_TIMEOUT_S = 120
PORT_IN_USE = ("EADDRINUSE", "Address already in use", "address already in use")


class LaunchError(RuntimeError):
    """A multi-rank job cannot be launched here as configured; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """How jobs are launched in this session: a fixed rendezvous port (None: a free one per job)."""

    port: int | None = None


def torchrun_program() -> list[str]:
    """torchrun as this interpreter runs it, `python -m torch.distributed.run` (what the `torchrun`
    script does): an environment that is not activated, whose bin directory is not on PATH, works
    too. LaunchError if this interpreter's torch has no torch.distributed."""
    try:
        found = importlib.util.find_spec("torch.distributed.run") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise LaunchError(f"{sys.executable} cannot import torch.distributed.run: a multi-rank trainer (world size > 1) "
                          "is launched with torchrun\n  fix: install a torch built with torch.distributed in this "
                          "environment")
    return [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port(port: int) -> None:
    """LaunchError if `port` on 127.0.0.1 cannot be bound (in use, or not allowed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            what = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise LaunchError(f"rendezvous port {port} on 127.0.0.1 {what}\n  fix: free the port, or leave "
                              "--rdzv-port unset so that every job gets a free port") from None


def node_address(node: int) -> str:
    """Node k's loopback address: their order as strings is the order of k (k < 90), which is how
    the c10d rendezvous numbers nodes."""
    return f"127.0.{10 + node}.1"


def log_dir(stderr_path: Path) -> Path:
    """Where the agents of the job whose stderr goes to `stderr_path` keep their log directories
    (one per agent, with one per attempt in it): beside that file, in the run's own directory.
    Without `--log-dir` every agent makes a /tmp/torchelastic_* directory that nothing removes
    (about a thousand per run of the project's tests)."""
    return stderr_path.with_name(stderr_path.name + ".torchrun")


def torchrun_flags(spec: RunSpec, port: int, node: int = 0, *, logs: Path) -> list[str]:
    """torchrun's flags for the job of `spec` (for node `node` of a job of several nodes), its
    agents' logs under `logs` (log_dir). Its `max_restarts` (0 but under elastic_restart) is how
    often torchrun restarts the workers in place after one fails."""
    shape = [f"--nnodes={spec.nnodes}", f"--nproc-per-node={spec.ranks_per_node}",
             f"--max-restarts={spec.max_restarts}", f"--monitor-interval={MONITOR_INTERVAL_S:g}",
             f"--log-dir={logs}"]
    if spec.nnodes == 1 and not spec.max_restarts:
        return [*shape, "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}"]
    # Several nodes meet through c10d; so does a job restarted in place (a store per attempt, see rank_env).
    c10d = [*shape, "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=conformance-{port}"]
    if spec.nnodes == 1:
        return c10d
    return [*c10d, f"--local-addr={node_address(node)}", f"--rdzv-conf=join_timeout={JOIN_TIMEOUT_S}"]


def fresh_argv(trainer_argv: list[str] | tuple[str, ...], spec: RunSpec, port: int, node: int = 0, *,
               logs: Path) -> list[str]:
    """The torchrun command line of a job (or of one node's agent) in fresh interpreters."""
    return [*torchrun_program(), *torchrun_flags(spec, port, node, logs=logs), "--no-python", sys.executable, "-m",
            "conformance.run.rank", *trainer_argv]


def rank_env(env: dict[str, str], spec: RunSpec, *, stderr_template: Path, straces: dict[int, list[str]],
             announce: Path | None = None) -> dict[str, str]:
    """`env` plus what the rank entry point reads, and what the agents of `spec`'s job read."""
    env = dict(env)
    if spec.max_restarts:
        # torchrun restarting its workers in place hands the new attempt the store of the one
        # before (pytorch/pytorch#135712, #167288): a restarted rank that starts before a slower
        # peer reads that peer's old address and fails to connect, whatever the trainer does. A
        # store of the workers' own per attempt (rank 0's, on a new port) avoids it.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env[STDERR_VAR] = str(stderr_template)
    env[STRACE_VAR] = json.dumps({str(r): p for r, p in straces.items()})
    if announce is not None:
        env[ANNOUNCE_VAR] = str(announce)
        env[TRACER_VAR] = str(os.getpid())
    # torchrun sets this for W > 1 when it is unset (and prints a banner saying so): set it first.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def port_in_use(stderr: str) -> bool:
    return any(s in stderr for s in PORT_IN_USE)


def rank_stderr(template: Path | str, rank: int) -> Path:
    return Path(str(template).replace("{rank}", str(rank)))
