"""The layout protocol (reference/layouts/kinds.py): every layout implements it, behaves alike
through it, and no module outside the layouts branches on a layout's name."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from resume_conformance import reference
from resume_conformance.reference import names
from resume_conformance.reference.errors import CheckpointError
from resume_conformance.reference.layouts import kinds

REPO = Path(__file__).resolve().parent.parent
PROTOCOL = [n for n, v in vars(kinds.Layout).items() if inspect.isfunction(v) and not n.startswith("_")]


def _payload(step: int) -> dict:
    torch.manual_seed(step)
    return {"schema": "reference-checkpoint/2", "model": {"w": torch.randn(4, 3), "b": torch.zeros(3)},
            "counters": {"global_step": step}}


@pytest.mark.parametrize("name", names.LAYOUTS)
def test_every_layout_implements_the_protocol(name):
    layout = kinds.named(name)
    assert layout.name == name
    for method in PROTOCOL:
        ours = inspect.signature(getattr(kinds.Layout, method))
        theirs = inspect.signature(getattr(type(layout), method))
        assert list(theirs.parameters) == list(ours.parameters), f"{type(layout).__name__}.{method}{theirs}"


@pytest.mark.parametrize("name", names.LAYOUTS)
def test_a_layout_saves_opens_records_and_removes_through_the_protocol(tmp_path, name):
    manager = reference.CheckpointManager(tmp_path, layout=name, keep_last=5, **(
        {"strategy": "incremental"} if name == "chain" else {}))
    paths = [manager.save(_payload(s), step=s, metric=float(10 - s), force=True) for s in (1, 2)]
    layout = kinds.of(paths[1])
    assert layout.name == name and paths[1] == layout.path_for(manager.directory, 2)
    assert kinds.named(name).is_directory == paths[1].is_dir()
    layout.verify(paths[1])
    layout.check_committed(paths[1])
    assert torch.equal(layout.open(paths[1])["model"]["w"], _payload(2)["model"]["w"])
    assert reference.catalog.read_meta(reference.list_checkpoints(manager.directory)[1])["metric"] == 8.0
    needs = layout.needs(paths[1])
    assert paths[1].name in needs and (paths[0].name in needs) == (name == "chain")
    layout.remove(paths[1])
    assert not paths[1].exists()
    with pytest.raises(CheckpointError):
        layout.check_committed(paths[1])


def test_a_reading_chain_layout_cannot_save(tmp_path):
    with pytest.raises(TypeError, match="CheckpointManager"):
        kinds.named("chain").save(_payload(1), tmp_path / "step-00000001.chain.json", step=1, metric=None, meta={})


def _branches_on_a_layout_name(tree: ast.AST) -> list[int]:
    """Lines comparing something to a layout's name ("file", "sharded", "chain")."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value in names.LAYOUTS for o in operands):
                found.append(node.lineno)
    return found


def test_no_module_outside_the_layouts_branches_on_a_layout_name():
    """The protocol is asked instead. A layout's own modules (layouts/, chain/) know their own
    name; names.py parses names; distributed.py's DCP directories are a format of their own."""
    allowed = {"reference/names.py", "reference/distributed.py", "reference/config.py"}
    bad = {}
    for path in sorted((REPO / "reference").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in allowed or rel.startswith(("reference/bench/", "reference/layouts/", "reference/chain/")):
            continue
        lines = _branches_on_a_layout_name(ast.parse(path.read_text()))
        if lines:
            bad[rel] = lines
    assert not bad, f"branches on a layout name (ask reference.layouts.kinds instead): {bad}"
