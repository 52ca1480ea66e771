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
    {"operations", "recording", "saves", "alignment", "failures", "plots", "proctree", "watchdog"},
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
def test_no_module_over_400_lines(package):
    long = {str(p.relative_to(REPO)): n for p, _ in _modules(package)
            if (n := len(p.read_text().splitlines())) > 400}
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


def test_the_checks_package_names_the_module_of_every_check():
    import re

    import conformance.checks as checks
    from conformance.checks.registry import CHECKS
    rows = dict(re.findall(r"^\| (\w+\.py) \| (.+) \|$", checks.__doc__, re.MULTILINE))
    decided = {cid.strip() for ids in rows.values() for cid in ids.split(",")}
    assert decided == {c.id for c in CHECKS}, "conformance/checks/__init__.py's table and the registry differ"
    for module, ids in rows.items():
        source = (REPO / "conformance" / "checks" / module).read_text()
        assert all(re.search(rf"\b{cid.strip()}\b", source) for cid in ids.split(",")), f"{module} does not decide {ids}"


def test_the_reference_library_page_names_every_module():
    page = (REPO / "docs" / "reference-library.md").read_text()
    missing = [p.name for p in sorted((REPO / "reference").glob("*.py")) if f"`{p.name}`" not in page]
    assert not missing, f"docs/reference-library.md's module table lacks {missing}"


def _imports_of(path: Path, package: str) -> set[str]:
    """The sibling modules `path` imports, deferred imports included (`from .x import`, `from . import x`,
    `from package.x import`); not those only a type checker reads."""
    out = set()

    def nodes(tree):     # what runs: an `if TYPE_CHECKING:` block never does
        for node in ast.iter_child_nodes(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                continue
            yield node
            yield from nodes(node)
    for node in nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1 and mod:
                out.add(mod.split(".")[0])
            elif node.level == 1:
                out.update(a.name for a in node.names)
            elif node.level == 0 and mod.startswith(package + "."):
                out.add(mod[len(package) + 1:].split(".")[0])
    return out


@pytest.mark.parametrize("package", ["conformance", "conformance/checks", "reference", "reference/bench"])
def test_no_import_cycle_between_the_modules_of_a_package(package):
    """Deferred imports count: a cycle is a cycle whenever it runs."""
    modules = {p.stem: p for p in (REPO / package).glob("*.py")}
    graph = {m: _imports_of(p, package.replace('/', '.')) & set(modules) - {m} for m, p in modules.items()}
    cycles = []

    def visit(node, path):
        for nxt in sorted(graph[node]):
            if nxt == path[0]:
                cycles.append(" -> ".join(path + [nxt]))
            elif nxt not in path and nxt > path[0]:
                visit(nxt, path + [nxt])
    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, f"import cycles in {package}/: {cycles[:5]}"


def test_the_design_page_names_every_module_in_its_layer():
    """docs/design.md's table and LAYERS (what this file enforces) say the same thing."""
    import re
    rows = re.findall(r"^\| (\d) \| ([^|]+) \|", (REPO / "docs" / "design.md").read_text(), re.MULTILINE)
    documented = {name.removesuffix(".py"): int(layer) for layer, cell in rows
                  for name in re.findall(r"`([\w./*]+)`", cell) if "/" not in name}
    assert documented == {m: LAYER_OF[m] for m in documented} and set(documented) == set(LAYER_OF) - {"checks"}, (
        sorted(set(LAYER_OF) - {"checks"} - set(documented)), {m: (l, LAYER_OF.get(m)) for m, l in documented.items()
                                                               if LAYER_OF.get(m) != l})
