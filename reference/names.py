"""A checkpoint's name and its step: the one place they are formatted and parsed, and a directory
is scanned for them.

`step-00000012` a sharded directory (and a committed DCP checkpoint), `step-00000012.pt` one file,
`step-00000012.chain.json` a chained checkpoint's manifest, `.staging-step-00000012` a DCP save
still in progress. Eight digits keep names sorted by step as strings too, but every reader orders
by the number parsed here, never by the string.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

CHAIN_SUFFIX = ".chain.json"
FILE_SUFFIX = ".pt"
_SUFFIX_OF = {"sharded": "", "file": FILE_SUFFIX, "chain": CHAIN_SUFFIX}
LAYOUTS = tuple(_SUFFIX_OF)   # "sharded", "file", "chain"
_NAME_RE = re.compile(r"^step-(?P<step>[0-9]+)(?P<ext>\.pt|\.chain\.json)?$")
_STAGING_RE = re.compile(r"^\.staging-step-(?P<step>[0-9]+)$")


def step_name(step: int, layout: str = "sharded") -> str:
    """The name of the checkpoint of `step` in `layout` ("sharded", "file" or "chain")."""
    return f"step-{step:08d}{_SUFFIX_OF[layout]}"


def staging_name(step: int) -> str:
    """Where a multi-rank save of `step` is written before its rename commits it."""
    return f".staging-step-{step:08d}"


def parse(name: str) -> tuple[int, str] | None:
    """(step, layout) of a checkpoint name this library writes, or None for any other name."""
    m = _NAME_RE.match(name)
    return None if m is None else (int(m.group("step")), layout_of(name))


def layout_of(name: str) -> str:
    """The layout a checkpoint's name says, by its suffix: the one rule, which `parse` uses too (a
    name without a suffix is a sharded directory). A path is mapped to its layout by
    `layouts.kinds.of`, which asks this."""
    return next((layout for layout, suffix in _SUFFIX_OF.items() if suffix and name.endswith(suffix)), "sharded")


def step_of(name: str) -> int:
    """The step a checkpoint name starts with (ValueError if it names none)."""
    m = re.match(r"^step-([0-9]+)", name)
    if m is None:
        raise ValueError(f"not a step-named checkpoint: {name!r}")
    return int(m.group(1))


def staging_step(name: str) -> int | None:
    """The step of a DCP staging directory's name, or None."""
    m = _STAGING_RE.match(name)
    return int(m.group("step")) if m else None


@dataclasses.dataclass(frozen=True)
class StepEntry:
    """An entry of a directory with a checkpoint's name: its step, the layout its name says, and
    whether it is a directory itself (a link to one is not)."""
    step: int
    layout: str
    path: Path
    is_dir: bool


def step_entries(directory: str | os.PathLike) -> list[StepEntry]:
    """Every entry of `directory` named as a checkpoint (committed or not), oldest first by step
    number, never by string: the one scan that the catalog's listing and chain's garbage collection
    both filter. An absent directory holds none."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in os.scandir(directory):
        parsed = parse(entry.name)
        if parsed is not None:
            found.append(StepEntry(parsed[0], parsed[1], Path(entry.path), entry.is_dir(follow_symlinks=False)))
    return sorted(found, key=lambda e: (e.step, e.path.name))
