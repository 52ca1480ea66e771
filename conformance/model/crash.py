"""Crash points and schedules: data, never timers, so every failure replays exactly and
Hypothesis can shrink it.

A schedule is a tuple of crash points, one per killed process (or job); after the last one the
suite runs the trainer once more, uninterrupted. Text form (used by replay): `step:4,save:6/3`;
for a multi-rank trainer each point names the rank it kills: `save:6/3@r1,step:4@r0`; in a
multi-node job (`--nnodes`) a node point names the node it takes down whole: `save:6/3@node1`.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CrashPoint:
    """`step:k`: kill after step k is logged (on entry to the write that would log step k+1).
    `save:s/i` (`save:s/tL/i`): kill on entry to the i-th filesystem mutation (1-based) of the save
    of step s on its logging thread (on its background thread L, numbered in order of appearance
    within that save; saves.py says which save and thread an operation belongs to). The name does
    not depend on how threads interleave, so it replays the same operation in every run.
    `fs:i`: kill on entry to the i-th filesystem mutation under the checkpoint directory (0-based,
    in the process's own uninterrupted trace, in the order the calls were entered; it wraps around),
    or the first one after it that a kill by count can hit exactly: for operations outside any save
    and for processes whose trace is not known in advance. `retention:s/i`: kill on entry to the
    i-th operation (1-based) of the retention pass after the save of step s (removals of older
    checkpoints, on whatever thread they run: saves.retention_passes). `@rN`: in a multi-rank job, the point is
    rank N's (its own steps, its own mutations); torchrun then stops the other ranks. `@nodeK`: a
    node point, in a job of several nodes: at that step or operation of node K's first rank, node K
    is lost whole (its agent and all its ranks stop at once, as in a power or network loss of one
    machine); the other nodes notice at their next collective. Its rank is bound from the job's
    shape (`bound`), so the text names the node only and replays on any job of that shape."""

    kind: str
    index: int                 # step k; fs mutation i; the save's step s
    rank: int | None = None
    op: int = 0                # save and retention points: the operation's 1-based position there
    thread: int = 0            # save points: 0 the logging thread, L the save's L-th other thread
    node: int | None = None    # a node point: the node lost whole (its rank: that node's first, see bound)

    KINDS = ("step", "fs", "save", "retention")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"crash point kind must be one of {self.KINDS}, got {self.kind!r}")
        if self.index < 0:
            raise ValueError(f"crash point index must be >= 0, got {self.index}")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"crash point rank must be >= 0, got {self.rank}")
        if self.node is not None and self.node < 0:
            raise ValueError(f"crash point node must be >= 0, got {self.node}")
        if self.kind == "save":
            if self.index < 1 or self.op < 1 or self.thread < 0:
                raise ValueError(f"a save point names a save step >= 1, a thread >= 0 and an operation >= 1, "
                                 f"got save {self.index}, thread {self.thread}, operation {self.op}")
        elif self.kind == "retention":
            if self.index < 1 or self.op < 1 or self.thread:
                raise ValueError(f"a retention point names a save step >= 1 and an operation >= 1 (no thread), "
                                 f"got save {self.index}, operation {self.op}")
        elif self.op or self.thread:
            raise ValueError(f"only a save or retention point names an operation, not a {self.kind!r} point")

    def __str__(self) -> str:
        body = f"{self.kind}:{self.index}"
        if self.kind in ("save", "retention"):
            body += (f"/t{self.thread}" if self.thread else "") + f"/{self.op}"
        if self.node is not None:
            return body + f"@node{self.node}"
        return body + (f"@r{self.rank}" if self.rank is not None else "")

    @property
    def on_rank(self) -> int:
        """The rank whose process this point stops (0 for a single process); for a node point,
        the node's first rank, once `bound`."""
        if self.node is not None and self.rank is None:
            raise ValueError(f"node point {self} is not bound to a job's shape (CrashPoint.bound)")
        return self.rank or 0

    @property
    def whole_node(self) -> bool:
        """Whether the point takes a whole node down, not one rank."""
        return self.node is not None

    def bound(self, ranks_per_node: int) -> CrashPoint:
        """A node point with its rank filled in: node K's first rank, K * ranks_per_node, as torchrun
        numbers ranks (RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK; the suite orders the
        rendezvous so that node K is GROUP_RANK K, see launch.py). Other points unchanged."""
        if self.node is None:
            return self
        return dataclasses.replace(self, rank=self.node * ranks_per_node)

    def stopped(self) -> str:
        """What the point does, for messages: "rank 1 was killed", "node 1 was lost"."""
        return f"node {self.node} was lost" if self.node is not None else f"rank {self.on_rank} was killed"

    @property
    def at_step(self) -> bool:
        """Whether it is a step point (delivered on the loss log); else it names an operation."""
        return self.kind == "step"

    @classmethod
    def parse(cls, text: str) -> CrashPoint:
        body, at, rank = text.strip().partition("@")
        kind, _, where = body.partition(":")
        try:
            node = None
            if at and rank.startswith("node"):
                on, node = None, int(rank[4:])
            elif at and not rank.startswith("r"):
                raise ValueError("the rank is written '@r<N>', a node '@node<K>'")
            else:
                on = int(rank[1:]) if at else None
            parts = where.split("/")
            if kind == "retention":
                if len(parts) != 2:
                    raise ValueError("a retention point is written 'retention:S/I'")
                return cls(kind, int(parts[0]), on, op=int(parts[1]), node=node)
            if kind != "save":
                return cls(kind, int(where), on, node=node)
            if len(parts) == 3 and parts[1].startswith("t"):
                return cls(kind, int(parts[0]), on, op=int(parts[2]), thread=int(parts[1][1:]), node=node)
            if len(parts) != 2:
                raise ValueError("a save point is written 'save:S/I' or 'save:S/tL/I'")
            return cls(kind, int(parts[0]), on, op=int(parts[1]), node=node)
        except ValueError as exc:
            raise ValueError(f"bad crash point {text!r}: expected 'step:K', 'save:S/I', 'save:S/tL/I', "
                             "'retention:S/I' or 'fs:I', "
                             f"optionally with '@rN' for rank N or '@nodeK' for node K ({exc})") from None


Schedule = tuple[CrashPoint, ...]


def format_schedule(schedule: Schedule) -> str:
    return ",".join(map(str, schedule)) or "none"


def parse_schedule(text: str) -> Schedule:
    text = text.strip()
    if text in ("", "none"):
        return ()
    return tuple(CrashPoint.parse(part) for part in text.split(","))


def bound(schedule: Schedule, ranks_per_node: int) -> Schedule:
    """`schedule` with its node points bound to a job of `ranks_per_node` ranks per node."""
    return tuple(p.bound(ranks_per_node) for p in schedule)


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
    def parse(cls, text: str) -> ColdFault:
        kind, _, n = text.strip().partition(":")
        try:
            return cls(kind, int(n))
        except ValueError as exc:
            raise ValueError(f"bad cold fault {text!r}: expected 'kill:N' or 'garble:N' ({exc})") from None
