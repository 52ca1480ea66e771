"""What varies between two runs of the same trainer: learned by aligning their operations, never
guessed from name patterns.

Two runs of a deterministic trainer make the same filesystem operations in the same order; only
some names may differ (`mkstemp`, `uuid4`, pid or clock based temp names, `mkdtemp` staging
directories). `align` walks both sequences of mutations in lockstep and keeps a one-to-one map
between the paths of the two runs. A path component that differs is a run-random name if it was
not in the directory before the run and maps consistently from then on; anything else (another
syscall, another save, a known name turning into a different one, one run ending early) is where
the runs diverge, and is reported in both runs.
"""
from __future__ import annotations

import dataclasses

from .recording import Op, RecordedRun


@dataclasses.dataclass(frozen=True)
class RunRandomName:
    """A name that differs between runs, known by the operation that first used it."""

    role: str          # e.g. "create #1 of the save of step 3"
    first: str         # the path in the first run
    second: str        # the path in the second run

    def describe(self) -> str:
        return f"{self.first} / {self.second} ({self.role})"


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first operation at which two runs differ."""

    position: int      # index into both runs' mutation sequences
    first: str         # that operation in the first run (its role and what it did)
    second: str

    def describe(self, first_name: str = "run 1", second_name: str = "run 2") -> str:
        return (f"operation #{self.position} differs: {first_name}: {self.first}; "
                f"{second_name}: {self.second}")


@dataclasses.dataclass(frozen=True)
class Alignment:
    names: tuple[RunRandomName, ...]
    divergence: Divergence | None
    compared: int      # mutations compared


def _describe(run: RecordedRun, op: Op | None) -> str:
    if op is None:
        return "nothing (the run had no more operations)"
    return f"{run.role(op.index)}: {op.describe()}"


class _PathMap:
    """A one-to-one map between the paths of two runs, grown one component at a time."""

    def __init__(self, preexisting: frozenset[str]):
        self.forward: dict[str, str] = {}
        self.backward: dict[str, str] = {}
        self.preexisting = preexisting
        self.new: list[tuple[str, str]] = []

    def match(self, a: str, b: str) -> bool:
        ca, cb = a.split("/"), b.split("/")
        if len(ca) != len(cb):
            return False
        for i, (x, y) in enumerate(zip(ca, cb)):
            pa, pb = "/".join(ca[:i + 1]), "/".join(cb[:i + 1])
            known = self.forward.get(pa)
            if known is not None:
                if known != pb:
                    return False
                continue
            if pb in self.backward or (x != y and pa in self.preexisting):
                return False
            self.forward[pa], self.backward[pb] = pb, pa
            if x != y:
                self.new.append((pa, pb))
        return True


def _in_order(run: RecordedRun, upto: int | None) -> list[int]:
    """The mutations two runs must make alike, in the order they must agree on: as they happened
    for one thread; each save's operations thread by thread when several threads wrote (how
    threads interleave is a race, not a property of the trainer). Retention is left out: when a
    background deletion lands is a race too; what it leaves is compared (`retention_outcome`)."""
    chosen = run.mutations if upto is None else run.mutations[:upto]
    chosen = [i for i in chosen if not run.ops[i].retention]
    if not any(run.ops[i].lane for i in chosen):
        return list(chosen)
    return sorted(chosen, key=lambda i: (run.ops[i].rank, run.ops[i].save, run.ops[i].lane, i))


def align(first: RecordedRun, second: RecordedRun, *, upto: int | None = None) -> Alignment:
    """Align the mutations of two runs that started from the same directory (the first `upto`
    of the second run's, if given: a killed run is compared up to its kill). Each operation must
    belong to the same save, on the same thread of it, in the same order."""
    ma, mb = _in_order(first, upto), _in_order(second, upto)
    paths = _PathMap(first.preexisting)
    names: list[RunRandomName] = []
    for k in range(max(len(ma), len(mb))):
        oa = first.ops[ma[k]] if k < len(ma) else None
        ob = second.ops[mb[k]] if k < len(mb) else None
        same = (oa is not None and ob is not None and oa.kind == ob.kind and oa.syscall == ob.syscall
                and oa.save == ob.save and oa.lane == ob.lane and paths.match(oa.path, ob.path)
                and paths.match(oa.target, ob.target))
        if not same:
            return Alignment(tuple(names), Divergence(k, _describe(first, oa), _describe(second, ob)), k)
        for pa, pb in paths.new:
            names.append(RunRandomName(first.role(oa.index), pa, pb))
        paths.new.clear()
    return Alignment(tuple(names), None, max(len(ma), len(mb)))


def align_job(first: RecordedRun, second: RecordedRun) -> Alignment:
    """`align` for two runs of the same trainer, rank by rank for a job (the order in which ranks'
    operations interleave is a race, not a property of the trainer)."""
    if not first.is_job:
        return align(first, second)
    names: list[RunRandomName] = []
    compared = 0
    for r in sorted(first.ranks):
        if r not in second.ranks:
            return Alignment(tuple(names), Divergence(0, f"rank {r} was traced", f"rank {r} was not traced"), compared)
        lined_up = align(first.ranks[r], second.ranks[r])
        names += [dataclasses.replace(n, role=f"rank {r}: {n.role}") for n in lined_up.names]
        compared += lined_up.compared
        if lined_up.divergence is not None:
            d = lined_up.divergence
            return Alignment(tuple(names), Divergence(d.position, f"rank {r}: {d.first}", f"rank {r}: {d.second}"),
                             compared)
    return Alignment(tuple(names), None, compared)


def retention_outcome(first: RecordedRun, second: RecordedRun) -> str:
    """How the checkpoints two runs of the same trainer left once they were over differ ("" when
    they do not): retention whose outcome depends on timing (a deletion racing a save in flight)
    keeps a different set of checkpoints in a real restart too."""
    a, b = first.kept, second.kept
    if a == b:
        return ""

    def kept(found: dict[int, str]) -> str:
        return ", ".join(f"{s}" + ("" if how == "kept" else f" ({how})") for s, how in found.items()
                         if how != "removed") or "none"
    return f"run 1 kept the checkpoints of steps {kept(a)}; run 2 kept {kept(b)}"
