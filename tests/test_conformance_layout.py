"""Meta-tests of how the suite is put together: the subpackages are layers and imports run one way,
each subpackage imports only the layers it uses (USES), pytest is the plugin layer's alone, the
bundled trainers and the reference library use the suite only where they must, no import cycle, at
most 12 modules directly in a package, the suite reaches fixtures only through adapter strings,
and the docs' tables are generated from the code.

What a module must not mix is checked here as imports, not as a line count: a module that
needs a layer its package does not use is in the wrong package (or the layer's boundary moved,
and USES says so in one reviewed line)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conformance.report.checks_page import TABLE_MARKER, markdown_table
from conformance.report.readme import MODULES_MARKER, PAGES, module_table, table_after

REPO = Path(__file__).resolve().parents[1]
INSTALLED_AS = {"fixtures": "resume_conformance.fixtures", "reference": "resume_conformance.reference"}


def _modules(package: str):
    for path in sorted((REPO / package).rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path, ast.parse(path.read_text())


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] in INSTALLED_AS:    # fixtures/ and reference/ install under the project's name
        parts[:1] = INSTALLED_AS[parts[0]].split(".")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree):
    """Every node that can run: an `if TYPE_CHECKING:` block never does; deferred imports do."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(path: Path, tree: ast.AST, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports, relative imports resolved, deferred ones included."""
    here = _dotted(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for alias in node.names:
                out.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out & known - {here}


def _graph(package: str) -> dict[str, set[str]]:
    modules = {_dotted(p): (p, t) for p, t in _modules(package)}
    return {m: _imports(p, t, set(modules)) for m, (p, t) in modules.items()}


def _layer(module: str) -> str:
    """A conformance module's layer: its subpackage, or "" for a module directly in conformance/."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (REPO / "conformance" / parts[1]).is_dir() else ""


def test_every_subpackage_of_conformance_is_a_layer():
    from conformance import LAYERS
    declared = [name for names in LAYERS for name in names]
    folders = {p.name for p in (REPO / "conformance").iterdir() if (p / "__init__.py").is_file()}
    assert sorted(declared) == sorted(folders | {""}), (sorted(declared), sorted(folders))


def test_imports_run_one_way():
    from conformance import LAYERS
    index = {name: i for i, names in enumerate(LAYERS) for name in names}
    upward = [f"{m} (layer {index[_layer(m)]}) imports {d} (layer {index[_layer(d)]})"
              for m, deps in sorted(_graph("conformance").items()) for d in sorted(deps)
              if index[_layer(d)] > index[_layer(m)]]
    assert not upward, upward


@pytest.mark.parametrize("package", ["conformance", "reference"])
def test_at_most_12_modules_directly_in_a_package(package):
    """The folders show the architecture: a new module goes into the subpackage it belongs to."""
    direct = sorted(p.name for p in (REPO / package).glob("*.py"))
    assert len(direct) <= 12, direct


@pytest.mark.parametrize("path, tree", list(_modules("conformance")), ids=lambda v: getattr(v, "name", ""))
def test_the_suite_reaches_fixtures_and_reference_only_through_adapter_strings(path, tree):
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        bad = [n for n in names if n.split(".")[0] in ("fixtures", "reference", "resume_conformance")]
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"


# The layers each subpackage of conformance may import besides its own: narrower than "every layer
# below" (test_imports_run_one_way), and each narrowing is a boundary of the design.
USES = {
    "model": set(),                                   # the vocabulary: imports nothing of the suite
    "trace": {"model"},                               # reading a trace starts no process
    "run": {"model", "trace"},                        # runners know no fault plan and no check
    "offline": {"model", "trace"},                    # states rebuilt from a recording alone: never runs a trainer
    "faults": {"model", "trace", "run", "offline"},
    "checks": {"model", "trace", "run", "offline", "faults"},
    "report": {"model", "trace", "run", "checks"},    # renders outcomes: plans no fault, builds no state
    "cli": {"model", "report"},                       # runs the suite through pytest, never a check directly
    "bench": {"model", "trace", "run", "offline", "faults", "checks", "report"},   # measures any layer; not cli
    "": None,                                         # the plugin and the command line: any layer
}


def test_uses_names_every_layer_and_only_layers_below():
    from conformance import LAYERS
    index = {name: i for i, names in enumerate(LAYERS) for name in names}
    assert set(USES) == set(index), sorted(set(USES) ^ set(index))
    upward = {layer: sorted(u for u in uses if index[u] >= index[layer]) for layer, uses in USES.items() if uses}
    assert not any(upward.values()), f"USES lets a layer use its own level or one above: {upward}"


def test_a_subpackage_imports_only_the_layers_it_uses():
    """Two sibling layers (cli, bench) never import each other, offline never starts a trainer,
    report never reaches into faults or offline, and so on: see USES. Deferred imports count."""
    stray = [f"{m} ({_layer(m)}) imports {d} ({_layer(d)})"
             for m, deps in sorted(_graph("conformance").items()) if USES[_layer(m)] is not None
             for d in sorted(deps) if _layer(d) not in USES[_layer(m)] | {_layer(m)}]
    assert not stray, stray


def _absolute_imports(tree) -> list[str]:
    """Every module `tree` imports by its absolute name when it runs (deferred imports too)."""
    names = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_pytest_is_the_plugin_layers_and_hypothesis_stays_above_the_machinery():
    """pytest is imported only by the modules directly in conformance/ (the plugin, its report
    collection, the suite class, the options): every subpackage also runs outside pytest (replay,
    soak, bench, a fork server's child). Hypothesis draws crash points; trace, run and offline run
    and rebuild what a drawn point names and never draw one themselves."""
    mixed = []
    for path, tree in _modules("conformance"):
        layer, imported = _layer(_dotted(path)), {name.split(".")[0] for name in _absolute_imports(tree)}
        if layer and imported & {"pytest", "_pytest"}:
            mixed.append(f"{path.relative_to(REPO)} imports pytest")
        if layer in ("trace", "run", "offline") and "hypothesis" in imported:
            mixed.append(f"{path.relative_to(REPO)} imports hypothesis")
    assert not mixed, mixed


@pytest.mark.parametrize("package", ["fixtures", "reference"])
def test_the_bundled_trainers_and_the_reference_library_use_the_suite_only_where_they_must(package):
    """A bundled trainer is what a team writes: it may use the suite's vocabulary (conformance.model:
    TrainerAdapter, the loss record) and its public contract (conformance, conformance.contract),
    never its machinery. The reference library stands alone: only its benchmark, a development
    tool, writes its section of docs/benchmarks.md with the suite's section writer."""
    def allowed(path: Path, module: str) -> bool:
        if package == "fixtures":
            return module in ("conformance", "conformance.contract") or module.startswith("conformance.model.")
        return path.is_relative_to(REPO / "reference" / "bench") and module == "conformance.report.readme"
    stray = [f"{path.relative_to(REPO)} imports {module}" for path, tree in _modules(package)
             for module in _absolute_imports(tree) if module.split(".")[0] == "conformance" and not allowed(path, module)]
    assert not stray, stray


def test_readme_checks_table_is_the_registry():
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index(TABLE_MARKER) + 1
    while not lines[start].strip():
        start += 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    assert "\n".join(lines[start:end]) == markdown_table(), \
        "README's checks table is stale: regenerate it with python -m conformance.report.readme"


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


@pytest.mark.parametrize("package", ["conformance", "reference", "fixtures"])
def test_no_import_cycle_between_modules(package):
    """Across the whole package, subpackages included; deferred imports count: a cycle is a cycle
    whenever it runs. A package's `__init__` importing its own modules is not an edge back."""
    graph = _graph(package)
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    cycles = []

    def visit(node, path):
        for nxt in sorted(graph[node]):
            if nxt == path[0]:
                cycles.append(" -> ".join(path + [nxt]))
            elif nxt not in path and nxt > path[0] and len(cycles) < 5:
                visit(nxt, path + [nxt])
    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, f"import cycles in {package}/: {cycles[:5]}"


@pytest.mark.parametrize("page, package, layered", PAGES)
def test_a_docs_module_table_is_generated_from_the_docstrings(page, package, layered):
    import importlib
    layers = importlib.import_module(package).LAYERS if layered else None
    assert table_after(REPO / page, MODULES_MARKER) == module_table(REPO / package, layers), (
        f"{page}'s module table is stale: run `python -m conformance.report.readme`")


@pytest.mark.parametrize("package", [p.parent for p in sorted(REPO.glob("*/*/__init__.py"))
                                     if p.parts[-3] in ("conformance", "reference") and p.parent.name != "checks"],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_subpackage_docstring_names_each_of_its_modules(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    missing = [p.stem for p in sorted(package.glob("*.py")) if not p.stem.startswith("_") and f"`{p.stem}`" not in doc]
    assert not missing, f"{package.relative_to(REPO)}/__init__.py's docstring does not say what {missing} own"


def test_the_checks_page_is_generated_and_every_check_says_what_to_change():
    from conformance.checks.fixes import FIXES
    from conformance.checks.registry import CHECKS
    from conformance.report.checks_page import checks_page
    assert set(FIXES) == {c.id for c in CHECKS}
    assert (REPO / "docs" / "checks.md").read_text() == checks_page() + "\n", (
        "docs/checks.md is stale: run `python -m conformance.report.readme`")
