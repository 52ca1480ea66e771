"""Crash points and schedules: data, never timers, so every failure replays exactly and
Hypothesis can shrink it.

A schedule is a tuple of crash points, one per killed process; after the last one the suite runs
the trainer once more, uninterrupted. Text form (used by replay): `step:4,fs:17`.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CrashPoint:
    """`step:k`: kill after step k is logged (on entry to the write that would log step k+1).
    `fs:i`: kill on entry to the i-th filesystem mutation under the checkpoint directory
    (0-based, counted in that process's own uninterrupted trace)."""

    kind: str
    index: int

    def __post_init__(self):
        if self.kind not in ("step", "fs"):
            raise ValueError(f"crash point kind must be 'step' or 'fs', got {self.kind!r}")
        if self.index < 0:
            raise ValueError(f"crash point index must be >= 0, got {self.index}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> "CrashPoint":
        kind, _, index = text.strip().partition(":")
        try:
            return cls(kind, int(index))
        except ValueError as exc:
            raise ValueError(f"bad crash point {text!r}: expected 'step:K' or 'fs:I' ({exc})") from None


Schedule = tuple[CrashPoint, ...]


def format_schedule(schedule: Schedule) -> str:
    return ",".join(map(str, schedule)) or "none"


def parse_schedule(text: str) -> Schedule:
    text = text.strip()
    if text in ("", "none"):
        return ()
    return tuple(CrashPoint.parse(part) for part in text.split(","))
