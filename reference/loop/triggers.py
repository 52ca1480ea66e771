"""Save triggers, the public names teams import: when to checkpoint (every N steps, every T seconds,
when a metric improves, or time OR event with a minimum interval between saves), and why, recorded so
a resume decides alike. Re-exported here: the single triggers and their protocol are `single`'s, how
they combine is `combined`'s.

    trigger = hybrid(every_seconds(7200), on_metric("val_loss"), min_interval_s=600)
    decision = trigger.decide(step, {"val_loss": loss}, force=preemption.requested)
    if decision.save:
        payload["extra"]["trigger"] = trigger.record(decision)
        manager.save(payload, step=step, force=True)
        trigger.committed(decision)          # with blocking=False: after manager.wait()
    ...
    trigger.load_state_dict(payload["extra"]["trigger"]["state"])     # on resume

This module defines nothing: README, docs and teams' trainers import `reference.loop.triggers`, and
the names stay here while their code lives with its owner. It cannot keep the single triggers itself:
`combined` builds on them, so re-exporting `combined` from their module would be an import cycle.
"""
from __future__ import annotations

from .combined import AnyOf, Hybrid, any_of, forced_only, hybrid
from .single import (
    Clock,
    Decision,
    EverySeconds,
    EverySteps,
    OnMetric,
    Trigger,
    TriggerStateError,
    every_seconds,
    every_steps,
    on_metric,
)

__all__ = ["AnyOf", "Clock", "Decision", "EverySeconds", "EverySteps", "Hybrid", "OnMetric", "Trigger",
           "TriggerStateError", "any_of", "every_seconds", "every_steps", "forced_only", "hybrid", "on_metric"]
