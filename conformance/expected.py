"""Expected failures: adopt the gate incrementally.

A plain-text file, one entry per line, `<check id substring> : <reason>`; `#` starts a comment:

    # known gaps, tracked in JIRA-123
    resume_matches_baseline : NumPy RNG not in our checkpoints yet
    corruption_detected[bitflip] : shard hashes land next quarter

A check whose id contains an entry's substring is marked xfail with that reason (an xpass means
the entry can go). Entries that match no check id warn, so a typo does not silently do nothing.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .checks import CHECK_IDS, CHECK_PARAMS


class ExpectedFailuresError(ValueError):
    """The expected-failures file is missing or malformed."""


@dataclasses.dataclass(frozen=True)
class Entry:
    pattern: str
    reason: str
    line: int


def all_check_ids() -> list[str]:
    ids = []
    for check in CHECK_IDS:
        ids += [f"{check}[{k}]" for k in CHECK_PARAMS[check]] if check in CHECK_PARAMS else [check]
    return ids


def parse(path: str | Path) -> list[Entry]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ExpectedFailuresError(f"{path}: cannot read expected-failures file: {exc.strerror or exc}") from None
    entries = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        pattern, sep, reason = line.partition(":")
        pattern, reason = pattern.strip(), reason.strip()
        if not sep or not pattern or not reason:
            raise ExpectedFailuresError(f"{path}:{n}: expected '<check id substring> : <reason>', got {raw.strip()!r}")
        entries.append(Entry(pattern, reason, n))
    return entries


def match(entries: list[Entry], check_id: str) -> Entry | None:
    return next((e for e in entries if e.pattern in check_id), None)


def unmatched(entries: list[Entry]) -> list[Entry]:
    ids = all_check_ids()
    return [e for e in entries if not any(e.pattern in cid for cid in ids)]
