"""Replace a generated section of a Markdown page (README, docs) after its marker line.

Shared by `python -m conformance.bench` and `python -m resume_conformance.reference.bench`; it imports nothing
heavy, so neither command's `--help` pays for torch through it. The module tables of docs/design.md
and docs/reference-library.md are generated here too, from the modules' docstrings.
"""
from __future__ import annotations

import ast
import sys
from collections.abc import Sequence
from pathlib import Path


class MarkerMissing(ValueError):
    """The page has no line equal to the marker."""


def _replace_after(page: Path, marker: str, new: list[str], generated_ends) -> None:
    """Replace the lines after the line `marker` up to where `generated_ends(lines, start, i)` says."""
    page = Path(page)
    lines = page.read_text().splitlines()
    try:
        start = lines.index(marker)
    except ValueError:
        raise MarkerMissing(f"{page}: no line {marker!r} to put the generated text after") from None
    end = start + 1
    while end < len(lines) and not generated_ends(lines, start, end):
        end += 1
    lines[start + 1:end] = new
    page.write_text("\n".join(lines) + "\n")


def replace_section(page: Path, marker: str, section: str) -> None:
    """Replace what follows the line `marker`, up to the next heading, with `section`."""
    _replace_after(page, marker, ["", *section.splitlines(), ""], lambda lines, _, i: lines[i].startswith("#"))


def replace_table(page: Path, marker: str, table: str) -> None:
    """Replace the table that follows the line `marker` (the prose after it stays) with `table`."""
    _replace_after(page, marker, ["", *table.splitlines()],
                   lambda lines, start, i: not (lines[i].startswith("|") or (not lines[i].strip() and i == start + 1)))


def table_after(page: Path, marker: str) -> str:
    """The table that follows the line `marker` on `page`, as `replace_table` writes it."""
    lines = Path(page).read_text().splitlines()
    start = lines.index(marker) + 1
    while start < len(lines) and not lines[start].strip():
        start += 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end])


# -- module tables, generated from module docstrings ------------------------------------------------
MODULES_MARKER = "<!-- module table: generated from the modules' docstrings by `python -m conformance.report.readme` -->"


def summary(path: Path) -> str:
    """A module's docstring's first paragraph on one line (read with ast: nothing is imported)."""
    doc = ast.get_docstring(ast.parse(Path(path).read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def package_modules(package_dir: Path) -> list[Path]:
    """A package's modules, the ones directly in it first, then each subpackage's."""
    package_dir = Path(package_dir)
    return sorted((p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts),
                  key=lambda p: (len(p.relative_to(package_dir).parts) > 1, p.relative_to(package_dir).parts))


def module_table(package_dir: Path, layers: Sequence[Sequence[str]] | None = None) -> str:
    """One row per module with its docstring's first paragraph; with `layers` (subpackage names, lowest
    first; "" for the modules directly in the package), rows are grouped and numbered by layer."""
    package_dir = Path(package_dir)

    def sub(p):
        parts = p.relative_to(package_dir).parts
        return parts[0] if len(parts) > 1 else ""
    paths = package_modules(package_dir)
    if layers is None:
        rows = ["| module | what it owns |", "|---|---|"]
        rows += [f"| `{p.relative_to(package_dir).as_posix()}` | {summary(p)} |" for p in paths]
        return "\n".join(rows)
    rows = ["| layer | module | what it owns |", "|---|---|---|"]
    for i, names in enumerate(layers):
        rows += [f"| {i} | `{p.relative_to(package_dir).as_posix()}` | {summary(p)} |" for p in paths if sub(p) in names]
    return "\n".join(rows)


OPTIONS_MARKER = "<!-- options table: generated from conformance/model/flags.py by `python -m conformance.report.readme` -->"
PAGES = (("docs/design.md", "conformance", True), ("docs/reference-library.md", "reference", False))


def main(argv: Sequence[str] | None = None) -> int:
    """Regenerate the README's checks table, the module tables of docs/design.md and
    docs/reference-library.md, docs/checks.md and the options table of docs/running.md (run from
    the repository)."""
    import importlib
    root = Path(argv[0]) if argv else Path.cwd()
    for page, package, layered in PAGES:
        layers = importlib.import_module(package).LAYERS if layered else None
        replace_table(root / page, MODULES_MARKER, module_table(root / package, layers))
        print(f"updated {page}")
    from .checks_page import TABLE_MARKER, checks_page, markdown_table
    replace_table(root / "README.md", TABLE_MARKER, markdown_table())
    print("updated README.md")
    from ..model.flags import markdown_table as options_table
    replace_table(root / "docs" / "running.md", OPTIONS_MARKER, options_table())
    print("updated docs/running.md")
    (root / "docs" / "checks.md").write_text(checks_page() + "\n")
    print("updated docs/checks.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
