"""Crash points and schedules: data, never timers, so every failure replays exactly and
Hypothesis can shrink it.

A schedule is a tuple of crash points, one per killed process (or job); after the last one the
suite runs the trainer once more, uninterrupted. Text form (used by replay): `step:4,fs:17`; for a
multi-rank trainer each point names the rank it kills: `fs:17@r1,step:4@r0`.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CrashPoint:
    """`step:k`: kill after step k is logged (on entry to the write that would log step k+1).
    `fs:i`: kill on entry to the i-th filesystem mutation under the checkpoint directory
    (0-based, counted in that process's own uninterrupted trace). `@rN`: in a multi-rank job, the
    point is rank N's (its own steps, its own mutations); torchrun then stops the other ranks."""

    kind: str
    index: int
    rank: int | None = None

    def __post_init__(self):
        if self.kind not in ("step", "fs"):
            raise ValueError(f"crash point kind must be 'step' or 'fs', got {self.kind!r}")
        if self.index < 0:
            raise ValueError(f"crash point index must be >= 0, got {self.index}")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"crash point rank must be >= 0, got {self.rank}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}" + (f"@r{self.rank}" if self.rank is not None else "")

    @property
    def on_rank(self) -> int:
        """The rank whose process this point stops (0 for a single process)."""
        return self.rank or 0

    @classmethod
    def parse(cls, text: str) -> "CrashPoint":
        body, at, rank = text.strip().partition("@")
        kind, _, index = body.partition(":")
        try:
            if at and not rank.startswith("r"):
                raise ValueError("the rank is written '@r<N>'")
            return cls(kind, int(index), int(rank[1:]) if at else None)
        except ValueError as exc:
            raise ValueError(f"bad crash point {text!r}: expected 'step:K' or 'fs:I', optionally with "
                             f"'@rN' for rank N ({exc})") from None


Schedule = tuple[CrashPoint, ...]


def format_schedule(schedule: Schedule) -> str:
    return ",".join(map(str, schedule)) or "none"


def parse_schedule(text: str) -> Schedule:
    text = text.strip()
    if text in ("", "none"):
        return ()
    return tuple(CrashPoint.parse(part) for part in text.split(","))


@dataclasses.dataclass(frozen=True)
class ColdFault:
    """A fault at the Nth change a process makes to its cold tier (1-based, coldstore.py's
    numbering): `kill:N` dies just before it; `garble:N` lets it happen, then flips one byte of
    the object it wrote and reports success, as a store that corrupts silently would."""

    kind: str
    n: int

    KINDS = ("kill", "garble")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"cold fault kind must be one of {self.KINDS}, got {self.kind!r}")
        if self.n < 1:
            raise ValueError(f"cold fault change number must be >= 1, got {self.n}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.n}"

    @classmethod
    def parse(cls, text: str) -> "ColdFault":
        kind, _, n = text.strip().partition(":")
        try:
            return cls(kind, int(n))
        except ValueError as exc:
            raise ValueError(f"bad cold fault {text!r}: expected 'kill:N' or 'garble:N' ({exc})") from None
