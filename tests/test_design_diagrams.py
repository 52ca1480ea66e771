"""docs/design.md's two diagrams name real code: every module path, module, type and function
either one mentions exists in the suite, so a rename or a move breaks this test instead of leaving
the picture wrong. Names are read from the diagrams as they are written:

- `x/y.py`, `y.py`: a file of conformance/ (a bare name: in any of its folders), else of the repository;
- `conformance.a.b`, `tests.b`: a module, as `python -m` names it;
- `Name.attr` (a class's attribute or method) and `module.name` (a name `module` defines);
- `name()`: a function or method defined somewhere in conformance/;
- a capitalised word with a lower-case letter (`RecordedRun`, `Cut`): a class or a module-level
  name of conformance/. Words in capitals only (`KILL`, `PR_SET_PTRACER`) are not names.

Names under `torch.` are torch's and are not looked up.
"""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
DIAGRAMS = {"From a crash point to a verdict": 30, "The process tree": 15}   # heading -> at least this many names
EXTERNAL = ("torch",)
# The layers a crash point crosses on its way to a verdict (cli and bench are beside that path).
DATA_PATH_LAYERS = ("model", "trace", "run", "offline", "faults", "checks", "report")


def diagram(heading: str) -> str:
    """The first fenced block under the `## heading` of docs/design.md."""
    text = DESIGN.read_text()
    at = text.find(f"\n## {heading}\n")
    assert at >= 0, f"docs/design.md has no section '## {heading}'"
    block = re.search(r"```\w*\n(.*?)```", text[at:].split("\n## ", 2)[1], re.DOTALL)
    assert block, f"docs/design.md's '{heading}' has no diagram"
    return block.group(1)


@cache
def index() -> tuple[dict[str, set[str]], dict[str, set[str]], set[str]]:
    """(module stem -> names it defines at top level, class -> its attributes, every function name)."""
    modules: dict[str, set[str]] = {}
    classes: dict[str, set[str]] = {}
    functions: set[str] = set()
    for path in (REPO / "conformance").rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        names = modules.setdefault(path.stem if path.stem != "__init__" else path.parent.name, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.add(node.name)
            elif isinstance(node, ast.ClassDef):
                attrs = classes.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        attrs.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        attrs.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        attrs.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return modules, classes, functions


def _file_exists(path: str) -> bool:
    if "/" not in path:
        return any((REPO / "conformance").rglob(path)) or (REPO / path).is_file()
    return (REPO / "conformance" / path).is_file() or (REPO / path).is_file()


def _module_exists(dotted: str) -> bool:
    base = REPO.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def unknown_names(text: str) -> tuple[list[str], int]:
    """(the names `text` mentions that the code lacks, how many names it mentions)."""
    modules, classes, functions = index()
    defined = set(classes) | {n for names in modules.values() for n in names}
    missing, seen = [], 0
    text = re.sub(r"https?://\S+", "", text)
    for path in re.findall(r"[\w/]+\.py\b", text):
        seen += 1
        if not _file_exists(path):
            missing.append(f"{path} (no such file)")
    rest = re.sub(r"[\w/]+\.(py|json|md)\b", " ", text)
    for chain in re.findall(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", rest):
        parts = chain.split(".")
        if parts[0] in EXTERNAL:
            continue
        seen += 1
        if parts[0] in ("conformance", "tests"):
            if not _module_exists(chain):
                missing.append(f"{chain} (no such module)")
        elif len(parts) != 2:
            missing.append(f"{chain} (a name this test cannot look up)")
        elif parts[0] in classes:
            if parts[1] not in classes[parts[0]]:
                missing.append(f"{chain} (class {parts[0]} has no {parts[1]})")
        elif parts[0] in modules:
            if parts[1] not in modules[parts[0]]:
                missing.append(f"{chain} (module {parts[0]} defines no {parts[1]})")
        else:
            missing.append(f"{chain} (no module or class {parts[0]})")
    bare = re.sub(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", " ", rest)
    for name in re.findall(r"(?<![\w.-])([A-Za-z_]\w*)\(", bare):
        if name.isupper():
            continue
        seen += 1
        if name not in functions:
            missing.append(f"{name}() (no such function)")
    for name in re.findall(r"(?<![\w.-])([A-Z]\w*[a-z]\w*)\b(?!\()", bare):
        seen += 1
        if name not in defined:
            missing.append(f"{name} (no such class or name)")
    return sorted(set(missing)), seen


@pytest.mark.parametrize("heading", DIAGRAMS)
def test_every_name_a_design_diagram_mentions_is_in_the_code(heading):
    missing, seen = unknown_names(diagram(heading))
    assert not missing, f"docs/design.md's '{heading}' names what the code lacks: {missing}"
    assert seen >= DIAGRAMS[heading], f"'{heading}' names only {seen} things: is it still the diagram?"


def test_the_data_flow_diagram_crosses_every_layer_on_the_path():
    """Each layer a crash point crosses is a row label: a layer name, then the step it does."""
    text = diagram("From a crash point to a verdict")
    absent = [layer for layer in DATA_PATH_LAYERS if not re.search(rf"(^|\s){layer}\s{{2,}}\S", text, re.MULTILINE)]
    assert not absent, f"no row for layer(s) {absent}"


def test_the_name_check_catches_a_rename():
    """The checker itself: made-up names are reported, real ones are not."""
    missing, seen = unknown_names("scenario.plan() -> PlannedKill  scenario.planx()  PlannedKil  nosuch_fn()  "
                                  "conformance.run.nosuch  run/nosuch.py  RecordedRun.nosuch")
    assert missing == ["PlannedKil (no such class or name)", "RecordedRun.nosuch (class RecordedRun has no nosuch)",
                       "conformance.run.nosuch (no such module)", "nosuch_fn() (no such function)",
                       "run/nosuch.py (no such file)", "scenario.planx (module scenario defines no planx)"], missing
    assert seen == 8
