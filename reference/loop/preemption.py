"""SIGTERM, the scheduler's preemption notice (SLURM and Kubernetes send it, wait a grace period,
then SIGKILL), turned into a flag the training loop checks.

A handler that saves directly would run in the middle of whatever the main thread was doing,
possibly a save: a second, concurrent save of the same checkpoint. The guard only sets a flag;
the loop finishes the current step (and any save in progress), saves once, and exits with 128+15,
so the scheduler sees a preempted job, not a completed one.

    with reference.PreemptionGuard() as preemption:
        for batch in loader:
            ...
            if preemption.requested:
                manager.save(capture(...), force=True)
                sys.exit(preemption.EXIT_CODE)
"""
from __future__ import annotations

import signal
import threading


class PreemptionGuard:
    EXIT_CODE = 128 + signal.SIGTERM

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self.requested = False
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.requested, self.received = True, signum

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():   # signals only reach the main thread
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
