"""Conformance levels from a report, and the badge that states the highest one met.

    python -m conformance badge conformance-report/report.json --out conformance-badge.svg
"""
from __future__ import annotations

import dataclasses
from xml.sax.saxutils import escape

from ..checks.registry import LEVELS, level_ids


@dataclasses.dataclass(frozen=True)
class LevelStatus:
    level: str
    meaning: str
    status: str                 # "met", "not met", "not tested"
    missing: tuple[str, ...]    # check ids that did not pass (failed, xfailed) or did not run


def assess(outcomes: dict[str, str]) -> list[LevelStatus]:
    """Every level's status from {check id: outcome}."""
    out = []
    for level, meaning, checks in LEVELS:
        ids = level_ids(checks)
        not_run = [i for i in ids if outcomes.get(i) in (None, "skipped")]
        not_passed = [i for i in ids if i not in not_run and outcomes[i] not in ("passed", "xpassed")]
        status = "not met" if not_passed else "not tested" if not_run else "met"
        out.append(LevelStatus(level, meaning, status, tuple(not_passed or not_run)))
    return out


def highest(statuses: list[LevelStatus]) -> LevelStatus | None:
    """The highest level met with every level below it met too, or None."""
    best = None
    for s in statuses:
        if s.status != "met":
            break
        best = s
    return best


_COLORS = {"L4": "#2e7d32", "L3": "#43a047", "L2": "#7cb342", "L1": "#c0a000", None: "#c62828"}


def badge_svg(statuses: list[LevelStatus]) -> str:
    """A small flat badge: 'resume conformance | L2 power-loss durable' (no network, no fonts)."""
    top = highest(statuses)
    label, value = "resume conformance", (f"{top.level} {top.meaning}" if top else "no level met")
    color = _COLORS[top.level if top else None]
    lw, vw = 6 * len(label) + 12, 6 * len(value) + 12
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{lw + vw}" height="20" role="img" '
            f'aria-label="{escape(label)}: {escape(value)}">'
            f'<title>{escape(label)}: {escape(value)}</title>'
            f'<rect width="{lw}" height="20" fill="#555"/><rect x="{lw}" width="{vw}" height="20" fill="{color}"/>'
            f'<g fill="#fff" text-anchor="middle" font-family="Verdana,DejaVu Sans,sans-serif" font-size="11">'
            f'<text x="{lw / 2}" y="14">{escape(label)}</text><text x="{lw + vw / 2}" y="14">{escape(value)}</text>'
            f'</g></svg>\n')
