"""Lineage: every checkpoint's id, parent, run and branch, and the branches of a run directory.

A run directory holds the branch `main` at its top level. Resuming from a checkpoint that is not
the newest of its line starts a new branch in `branches/<name>/`, a checkpoint directory of its
own, so the new line never writes over (or retains away) the old line's later checkpoints.
`HEAD.json` names the branch a plain restart continues; it is written (atomically) only after the
branch's record, so a kill in between leaves the old line current and nothing half made.

A checkpoint's id is `<branch>@<step>`; its parent is the checkpoint its training state came
from: the previous save of this process, or the checkpoint it was loaded from (a branch point).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from .errors import CheckpointError, InvalidIndexError
from .primitives.atomic import atomic_write_bytes

MAIN = "main"
HEAD_NAME = "HEAD.json"
BRANCHES = "branches"
BRANCH_RECORD = "BRANCH.json"
_BRANCH_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ID_RE = re.compile(r"^(?P<branch>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})@(?P<step>[0-9]+)$")


class NoSuchCheckpointError(CheckpointError, LookupError):
    """`resume_from` (or a lineage reference) names a checkpoint that does not exist."""


@dataclasses.dataclass(frozen=True)
class Lineage:
    """What a checkpoint records about where it came from."""

    id: str
    parent: str | None
    run: str
    branch: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Any, where: str | os.PathLike) -> Lineage | None:
        """None for a checkpoint written before lineage existed; InvalidIndexError if malformed."""
        if value is None:
            return None
        if not (isinstance(value, dict) and set(value) == {"id", "parent", "run", "branch"}
                and all(isinstance(value[k], str) for k in ("id", "run", "branch"))
                and (value["parent"] is None or isinstance(value["parent"], str))
                and _ID_RE.match(value["id"]) and (value["parent"] is None or _ID_RE.match(value["parent"]))):
            raise InvalidIndexError(where, f"lineage must be {{id, parent, run, branch}} with ids like main@12, "
                                           f"got {value!r}"[:300])
        return cls(**value)


def checkpoint_id(branch: str, step: int) -> str:
    return f"{branch}@{step}"


def parse_id(text: str) -> tuple[str, int]:
    m = _ID_RE.match(text)
    if m is None:
        raise ValueError(f"not a checkpoint id (branch@step): {text!r}")
    return m.group("branch"), int(m.group("step"))


def check_branch_name(name: Any) -> str:
    if not isinstance(name, str) or not _BRANCH_RE.match(name):
        raise ValueError(f"branch name must be 1-64 characters of letters, digits, '_', '.', '-' "
                         f"(not starting with a symbol), got {name!r}")
    return name


@dataclasses.dataclass(frozen=True)
class Branch:
    name: str
    directory: Path
    parent_id: str | None         # the checkpoint it grew from (None for main)


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def branch_dir(run_dir: Path, branch: str) -> Path:
    return run_dir if branch == MAIN else run_dir / BRANCHES / check_branch_name(branch)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InvalidIndexError(path, f"cannot read: {exc}") from None


def read_head(run_dir: Path) -> str:
    """The branch a plain start continues: HEAD.json's, or `main` when there is none (a run
    that never branched writes no HEAD)."""
    path = run_dir / HEAD_NAME
    value = _read_json(path)
    if value is None:
        return MAIN
    if not (isinstance(value, dict) and isinstance(value.get("branch"), str)):
        raise InvalidIndexError(path, f"HEAD must be {{\"branch\": NAME}}, got {value!r}"[:200])
    branch = value["branch"]
    if branch != MAIN and read_branch(run_dir, branch) is None:
        raise InvalidIndexError(path, f"HEAD names branch {branch!r}, which has no {BRANCHES}/{branch}/{BRANCH_RECORD}")
    return branch


def write_head(run_dir: Path, branch: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / HEAD_NAME, json.dumps({"branch": check_branch_name(branch)}).encode() + b"\n")


def read_branch(run_dir: Path, name: str) -> Branch | None:
    if name == MAIN:
        return Branch(MAIN, run_dir, None)
    directory = branch_dir(run_dir, name)
    value = _read_json(directory / BRANCH_RECORD)
    if value is None:
        return None
    if not (isinstance(value, dict) and value.get("name") == name and isinstance(value.get("parent"), str)
            and _ID_RE.match(value["parent"])):
        raise InvalidIndexError(directory / BRANCH_RECORD, f"not a branch record for {name!r}: {value!r}"[:200])
    return Branch(name, directory, value["parent"])


def branches(run_dir: Path) -> list[Branch]:
    """`main` and every branch with a record, by name."""
    found = [Branch(MAIN, run_dir, None)]
    root = run_dir / BRANCHES
    if root.is_dir():
        for entry in sorted(os.listdir(root)):
            if _BRANCH_RE.match(entry):
                branch = read_branch(run_dir, entry)
                if branch is not None:
                    found.append(branch)
    return found


def create_branch(run_dir: Path, parent_id: str, name: str | None = None) -> Branch:
    """Record a new branch growing from `parent_id` (its directory and BRANCH.json); HEAD is
    moved by the caller once the branch exists."""
    taken = {b.name for b in branches(run_dir)}
    if name is None:
        n = len(taken)
        while f"branch-{n}" in taken:
            n += 1
        name = f"branch-{n}"
    check_branch_name(name)
    if name in taken:
        raise ValueError(f"branch {name!r} already exists in {run_dir}")
    directory = branch_dir(run_dir, name)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"name": name, "parent": parent_id}
    atomic_write_bytes(directory / BRANCH_RECORD, json.dumps(record, sort_keys=True).encode() + b"\n")
    return Branch(name, directory, parent_id)


def line_of(run_dir: Path, branch: str) -> list[tuple[Branch, int | None]]:
    """The branches a line reads back through, newest first, each with the highest step it
    contributes (None: all of its checkpoints): a branch's own checkpoints, then its parent
    branch's up to the branch point, and so on to `main`."""
    out: list[tuple[Branch, int | None]] = []
    limit: int | None = None
    seen: set[str] = set()
    current = read_branch(run_dir, branch)
    while current is not None and current.name not in seen:
        seen.add(current.name)
        out.append((current, limit))
        if current.parent_id is None:
            break
        parent_branch, limit = parse_id(current.parent_id)
        current = read_branch(run_dir, parent_branch)
    return out


def branch_points(run_dir: Path, branch: str) -> set[int]:
    """Steps of `branch` that another branch grew from: retention keeps them (an ancestor of a
    kept checkpoint)."""
    out = set()
    for b in branches(run_dir):
        if b.parent_id is not None:
            parent_branch, step = parse_id(b.parent_id)
            if parent_branch == branch:
                out.add(step)
    return out
