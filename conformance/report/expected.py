"""Expected failures: adopt the gate incrementally, like scikit-learn's `expected_failed_checks`.

A plain-text file, one entry per line, `<check id> : <reason>`; `#` starts a comment:

    # known gaps, tracked in JIRA-123
    resume_matches_baseline : NumPy RNG not in our checkpoints yet
    corruption_detected[bitflip] : shard hashes land next quarter
    no_lost_work : covers both of its parameters

An entry names a check id exactly (see `python -m conformance replay --help` or the README's
checks table), with or without its parameter; without it, it covers every parameter. Matching is
never by substring. An unknown id is a usage error naming the file and line.

Strict by default: a check listed here that passes (XPASS) fails the gate, saying to remove the
entry; `--expected-failures-lenient` lets it pass.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..checks.registry import BY_ID, all_check_ids, split_id


class ExpectedFailuresError(ValueError):
    """The expected-failures file is missing or malformed."""


@dataclasses.dataclass(frozen=True)
class Entry:
    check: str          # an exact check id, with or without its parameter
    reason: str
    line: int

    def covers(self, check_id: str) -> bool:
        return check_id == self.check or check_id.partition("[")[0] == self.check


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
        check, sep, reason = line.partition(":")
        check, reason = check.strip(), reason.strip()
        if not sep or not check or not reason:
            raise ExpectedFailuresError(f"{path}:{n}: expected '<check id> : <reason>', got {raw.strip()!r}")
        if check not in BY_ID:
            try:
                split_id(check)
            except KeyError:
                raise ExpectedFailuresError(
                    f"{path}:{n}: unknown check id {check!r}; known ids: {', '.join(known_ids())}") from None
        entries.append(Entry(check, reason, n))
    return entries


def known_ids() -> list[str]:
    """Ids an entry may name: every check, and every check with each of its parameters."""
    return list(dict.fromkeys(i for c in BY_ID.values() for i in [c.id, *c.ids()]))


def match(entries: list[Entry], check_id: str) -> Entry | None:
    return next((e for e in entries if e.covers(check_id)), None)


__all__ = ["Entry", "ExpectedFailuresError", "all_check_ids", "known_ids", "match", "parse"]
