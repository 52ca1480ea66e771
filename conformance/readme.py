"""Replace a generated section of a Markdown page (README, docs) after its marker line.

Shared by `python -m conformance.bench` and `python -m reference.bench`; it imports nothing
heavy, so neither command's `--help` pays for torch through it.
"""
from __future__ import annotations

from pathlib import Path


class MarkerMissing(ValueError):
    """The page has no line equal to the marker."""


def replace_section(page: Path, marker: str, section: str) -> None:
    """Replace what follows the line `marker`, up to the next heading, with `section`."""
    page = Path(page)
    lines = page.read_text().splitlines()
    try:
        start = lines.index(marker)
    except ValueError:
        raise MarkerMissing(f"{page}: no line {marker!r} to put the generated section after") from None
    end = start + 1
    while end < len(lines) and not lines[end].startswith("#"):
        end += 1
    lines[start + 1:end] = ["", *section.splitlines(), ""]
    page.write_text("\n".join(lines) + "\n")
