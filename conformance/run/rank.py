"""The entry point of every rank of a multi-rank job (see launch.py).

Fresh: torchrun runs `python -m conformance.run.rank <trainer argv>` for each rank; it sends the
rank's stderr to its own file and execs the trainer, under strace if the suite traces this rank.

Warm: `run_job` runs inside a process forked from the warm fork server: torchrun's own parser and
`elastic_launch`. Ranks are forked warm, but from a zygote the job forks before the agent starts
any thread (zygote.py says why); the agent manages a proxy per rank. A rank runs `warm_rank`: a
traced rank announces its pid and waits on a FIFO until the suite's strace has attached (as a warm
single process waits on its pipe), so the trace starts before the trainer's first instruction.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
from pathlib import Path

from ..model.process import mark_restart
from . import launch
from .attach import allow_tracer, announce_pid
from .child import run_target
from .zygote import RankZygote, proxy_rank


def _setup_rank() -> tuple[int, list[str]]:
    """Send stderr to this rank's file; return (rank, its strace prefix or []). Workers torchrun
    restarted in place (elastic_restart: TORCHELASTIC_RESTART_COUNT > 0) mark the restart in their
    loss log, add to their stderr file and run untraced: a fault is planned on, and proven in, the
    first attempt only."""
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    restarted = attempt > 0
    if restarted and os.environ.get("CONFORMANCE_LOSS_LOG"):
        mark_restart(Path(os.environ["CONFORMANCE_LOSS_LOG"]), rank, int(os.environ.get("WORLD_SIZE", "1")), attempt)
    template = os.environ.pop(launch.STDERR_VAR, "")
    straces = json.loads(os.environ.pop(launch.STRACE_VAR, "{}") or "{}")
    if template:
        mode = os.O_APPEND if restarted else os.O_TRUNC
        fd = os.open(launch.rank_stderr(template, rank), os.O_WRONLY | os.O_CREAT | mode, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    return rank, [] if restarted else list(straces.get(str(rank), []))


def main(argv: list[str]) -> None:
    """Fresh mode: exec the trainer (under strace for a traced rank)."""
    if not argv:
        raise SystemExit("usage: python -m conformance.run.rank <trainer command>")
    _, prefix = _setup_rank()
    command = prefix + argv
    os.execvp(command[0], command)


def warm_rank(target: str, argv: list[str], kind: str, env: dict[str, str]) -> int:
    """Warm mode, in a rank forked by the job's zygote with the environment torchrun's agent gave
    its proxy: wait for strace if traced, run the trainer; its exit status."""
    # A fresh rank starts with default signal dispositions; a forked one would inherit the job's
    # SIGTERM/SIGINT handlers, which only raise an exception when the interpreter next runs: a rank
    # blocked in a collective after a peer died would then ignore the agent's SIGTERM.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    rank, prefix = _setup_rank()
    announce = os.environ.pop(launch.ANNOUNCE_VAR, "")
    allow_tracer(int(os.environ.pop(launch.TRACER_VAR, "") or 0))   # the suite's strace, py-spy
    if prefix and announce:
        go = Path(announce) / f"go.rank{rank}"
        fd = os.open(go, os.O_RDONLY)   # the suite holds the FIFO's write end open: never blocks
        announce_pid(Path(announce), rank, os.getpid())
        os.read(fd, 1)                  # released once strace is attached
        os.close(fd)
    elif announce:   # untraced: its pid only tells the watchdog which process is this rank
        announce_pid(Path(announce), rank, os.getpid())
    return run_target(target, argv, dict(os.environ), kind)


# How often a warm agent polls the c10d rendezvous while it waits for the others (torchrun: 1 s).
RENDEZVOUS_POLL_S = 0.02


def _poll_rendezvous_faster() -> None:
    """c10d's rendezvous sleeps a second each time it finds the others not there yet (and up to
    0.3 s before its first round), and reads the shared state at most once a second: on one
    machine, where agents join within milliseconds, that is most of a multi-node job's time. A
    warm agent (this process only) polls and rereads every RENDEZVOUS_POLL_S instead; the
    protocol is unchanged. Both are private names of torch's (checked, left alone if absent); the
    fresh runner runs torchrun as it is."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is None or getattr(delay, "conformance_fast", False):
        return

    def fast(seconds) -> None:
        delay(min(seconds) if isinstance(seconds, tuple) else min(seconds, RENDEZVOUS_POLL_S))
    fast.conformance_fast = True
    dynamic_rendezvous._delay = fast
    holder = getattr(dynamic_rendezvous, "_BackendRendezvousStateHolder", None)
    init = getattr(holder, "__init__", None)
    if init is not None and init.__defaults__ == (1,):   # (cache_duration=1,)
        init.__defaults__ = (RENDEZVOUS_POLL_S,)


def run_job(flags: list[str], target: str, argv: list[str], kind: str) -> int:
    """Warm mode, in the job's process: what the `torchrun` program does with `flags`, with
    `warm_rank` as every rank's entry point. Returns torchrun's exit status (0, or 1 when a rank
    failed). The zygote is forked first, while one thread runs and before torchrun's modules are
    brought into sight (deferred.py): a rank has only what its trainer imports, as torchrun's do."""
    zygote = RankZygote.start(functools.partial(warm_rank, target, argv, kind))
    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch
        from torch.distributed.run import config_from_args, get_args_parser

        args = get_args_parser().parse_args([*flags, "--start-method=fork", "conformance-warm-rank"])
        config, _, _ = config_from_args(args)
        if args.rdzv_backend == "c10d":
            _poll_rendezvous_faster()
        try:
            elastic_launch(config=config, entrypoint=proxy_rank)(zygote.address)
        except ChildFailedError as exc:
            print(str(exc), file=sys.stderr)
            return 1
    except Exception as exc:   # the agent itself failed (rendezvous, a signal): as torchrun, exit 1
        print(f"torchrun agent: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        zygote.close()
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
