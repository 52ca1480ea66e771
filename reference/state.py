"""Capture the five kinds of training state into one payload, and put them back.

Model (parameters and buffers), optimizer, LR scheduler (plus an optional AMP GradScaler),
counters with the loss history and data-order state, and every RNG.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from .errors import CheckpointError, SchemaError
from .primitives.schema import CURRENT_SCHEMA
from .rng import capture_rng, restore_rng

_REQUIRED = ("schema", "model", "counters", "rng")


@dataclasses.dataclass
class TrainState:
    """What a load returns: the payload, typed. `model` etc. are state dicts."""

    global_step: int
    epoch: int
    batch_in_epoch: int
    loss_history: list[float]
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    data_order: dict[str, Any] | None
    rng: dict[str, Any]
    schema: str
    wall_saved_at: float | None
    extra: dict[str, Any]
    path: str | None = None

    @classmethod
    def from_payload(cls, payload: dict[str, Any], path: str | None = None) -> TrainState:
        missing = [k for k in _REQUIRED if k not in payload]
        if missing:
            raise SchemaError(path, f"payload lacks required field(s) {missing}")
        counters = payload["counters"]
        try:
            return cls(
                global_step=int(counters["global_step"]),
                epoch=int(counters["epoch"]),
                batch_in_epoch=int(counters["batch_in_epoch"]),
                loss_history=[float(x) for x in payload.get("loss_history", [])],
                model=payload["model"],
                optimizer=payload.get("optimizer"),
                scheduler=payload.get("scheduler"),
                scaler=payload.get("scaler"),
                data_order=payload.get("data_order"),
                rng=payload["rng"],
                schema=payload["schema"],
                wall_saved_at=payload.get("wall_saved_at"),
                extra=dict(payload.get("extra") or {}),
                path=path,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(path, f"malformed counters {counters!r}: {exc!r}") from exc

    def restore(self, model: torch.nn.Module | None = None, optimizer=None, scheduler=None,
                scaler=None, *, rng: bool = True, strict_rng: bool = True) -> None:
        """Load state dicts into live objects and restore every RNG. Failures raise."""
        if model is not None:
            model.load_state_dict(self.model)
        for name, obj, sd in (("optimizer", optimizer, self.optimizer),
                              ("scheduler", scheduler, self.scheduler),
                              ("scaler", scaler, self.scaler)):
            if obj is None:
                continue
            if sd is None:
                raise CheckpointError(self.path, f"checkpoint holds no {name} state but a {name} "
                                                 "was given to restore into")
            obj.load_state_dict(sd)
        if rng:
            restore_rng(self.rng, path=self.path, strict=strict_rng)


def capture(model: torch.nn.Module | dict[str, torch.Tensor], optimizer=None, scheduler=None,
            scaler=None, *, global_step: int, epoch: int = 0, batch_in_epoch: int = 0,
            loss_history: list[float] | None = None, data_order: dict[str, Any] | None = None,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build a payload (current schema) from live training objects. Tensors are not copied."""
    model_sd = model.state_dict() if isinstance(model, torch.nn.Module) else dict(model)
    return {
        "schema": CURRENT_SCHEMA,
        "wall_saved_at": time.time(),
        "model": model_sd,
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "counters": {"global_step": int(global_step), "epoch": int(epoch),
                     "batch_in_epoch": int(batch_in_epoch)},
        "loss_history": [float(x) for x in (loss_history or [])],
        "data_order": data_order,
        "rng": capture_rng(),
        "extra": dict(extra or {}),
    }
