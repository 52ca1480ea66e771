"""Meta-tests of how the suite is put together: imports run one way, the suite reaches fixtures
only through adapter strings, no module grows past ~400 lines, and the README's checks table is
the registry's."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conformance.checks.registry import TABLE_MARKER, markdown_table

REPO = Path(__file__).resolve().parents[1]
# conformance's modules, lowest layer first: a module imports only from its own layer or below.
LAYERS = [
    {"crash", "process", "strace", "settings", "evidence", "readme", "adapters", "corrupt", "child", "launch", "coldstore"},
    {"recording", "saves", "alignment", "failures", "plots", "watchdog"},
    {"runners", "forkserver", "rank", "attach"},
    {"delivery", "scenario", "crash_states", "powerloss", "faults", "strategies"},
    {"checks"},
    {"expected", "report", "suite", "plugin", "__main__", "bench", "test_conformance", "__init__", "usage", "init",
     "levels", "soak", "bench_ab"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules(package: str):
    for path in sorted((REPO / package).rglob("*.py")):
        yield path, ast.parse(path.read_text())


def _conformance_imports(path: Path, tree: ast.AST) -> set[str]:
    """Top-level conformance modules a file imports (checks/* counted as 'checks')."""
    inside_checks = path.parent.name == "checks"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").startswith("conformance."):
                found.add(node.module.split(".")[1])
            elif node.level == 1 and not inside_checks:
                found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            elif node.level == 1 and inside_checks:
                found.add("checks")
            elif node.level == 2:
                found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("conformance."))
    return found


def test_every_conformance_module_has_a_layer():
    names = {("checks" if p.parent.name == "checks" else p.stem) for p, _ in _modules("conformance")}
    assert names <= set(LAYER_OF), names - set(LAYER_OF)


@pytest.mark.parametrize("path, tree", list(_modules("conformance")), ids=lambda v: getattr(v, "name", ""))
def test_imports_run_one_way(path, tree):
    own = "checks" if path.parent.name == "checks" else path.stem
    upward = sorted(m for m in _conformance_imports(path, tree) if m in LAYER_OF and LAYER_OF[m] > LAYER_OF[own])
    assert not upward, f"{path.relative_to(REPO)} (layer {LAYER_OF[own]}) imports higher layers: {upward}"


@pytest.mark.parametrize("path, tree", list(_modules("conformance")), ids=lambda v: getattr(v, "name", ""))
def test_the_suite_reaches_fixtures_and_reference_only_through_adapter_strings(path, tree):
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        bad = [n for n in names if n.split(".")[0] in ("fixtures", "reference")]
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"


@pytest.mark.parametrize("package", ["conformance", "reference", "fixtures"])
def test_no_module_over_about_400_lines(package):
    long = {str(p.relative_to(REPO)): n for p, _ in _modules(package)
            if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long


def test_readme_checks_table_is_the_registry():
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index(TABLE_MARKER) + 1
    while not lines[start].strip():
        start += 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    assert "\n".join(lines[start:end]) == markdown_table(), \
        "README's checks table is stale: regenerate it from conformance.checks.registry.markdown_table()"
