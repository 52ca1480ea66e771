"""Which process identity a warm trainer process runs with, so that a resume meets what a real
restart meets.

Every fork of one server shares what the server's interpreter drew once: its string-hash secret
(set and dict-of-str order, `hash(name)`), and the state of every generator its imports seeded
from the OS (a module-level `random.Random()`, numpy's global generator). Real restarts draw them
anew. So the warm runner keeps two servers per trainer, each a fresh interpreter with its own
hash secret (unless the user's environment fixes PYTHONHASHSEED, as their real restarts then do),
and runs a process that starts where an earlier one left checkpoints on the other server than
that one: whatever a save depended on of its process, the resume that reads it has it different.
A run from an empty directory, which resumes nothing, uses the first.
"""
from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

IDENTITIES = 2


def random_hash_seeds(n: int, below: Callable[[int], int] = secrets.randbelow) -> list[int]:
    """`n` distinct PYTHONHASHSEED values (1 .. 2**32-1; 0 would turn hash randomization off)."""
    seeds: list[int] = []
    while len(seeds) < n:
        seed = 1 + below(2**32 - 1)
        if seed not in seeds:
            seeds.append(seed)
    return seeds


def hash_seeds(env: Mapping[str, str], root_seeds: list[str]) -> tuple[str, ...]:
    """The PYTHONHASHSEED of each identity's server: the user's own where their environment sets
    one; else the seeds of the fork roots a harness runs (forkclient.roots), when there are enough
    distinct ones; else fresh random ones."""
    if env.get("PYTHONHASHSEED"):
        return (env["PYTHONHASHSEED"],) * IDENTITIES
    distinct = list(dict.fromkeys(root_seeds))
    if len(distinct) >= IDENTITIES:
        return tuple(distinct[:IDENTITIES])
    return tuple(str(s) for s in random_hash_seeds(IDENTITIES))


class Identities:
    """Chooses the identity of each warm process by the checkpoint directory it starts on."""

    def __init__(self, seeds: tuple[str, ...]):
        self.seeds = seeds
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    def server_env(self, env: Mapping[str, str], identity: int) -> dict[str, str]:
        return dict(env, PYTHONHASHSEED=self.seeds[identity])

    def choose(self, ckpt_dir: Path) -> int:
        """The other identity than the last process on `ckpt_dir` (a directory wiped and
        restored from a cold tier too); for a directory no process of this runner used yet, the
        first if it is empty (nothing to resume), else the second (it holds what another
        process, or a copy of its files, left)."""
        key = os.path.realpath(ckpt_dir)
        with self._lock:
            if key in self._last:
                chosen = 1 - self._last[key]
            else:
                chosen = 1 if _has_entries(ckpt_dir) else 0
            self._last[key] = chosen
            return chosen


def _has_entries(directory: Path) -> bool:
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is not None
    except OSError:
        return False
