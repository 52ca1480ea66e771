"""One owner per fact, second pass: where a check is decided comes from its functions (the registry,
the checks package's table and docs/checks.md agree), where a trainer process's stderr goes is one
function's answer (run/runners.py), and how many crash states are decided at once is one function's
(checks/states.py, which the benchmark asks)."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from conformance.model.crash import CrashPoint

REPO = Path(__file__).resolve().parents[1]


def _sources(package: str = "conformance"):
    for path in sorted((REPO / package).rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path.relative_to(REPO).as_posix(), path.read_text()


def test_node_loss_is_decided_in_tiers_and_nodes():
    from conformance.checks import nodes, tiers
    from conformance.checks.registry import BY_ID
    check = BY_ID["node_loss"]
    assert check.decided_in == ("conformance/checks/tiers.py", "conformance/checks/nodes.py")
    assert [run for _, run in check.run.deciders] == [tiers.node_loss, nodes.node_loss]


def test_every_check_is_decided_in_the_modules_of_its_functions():
    from conformance.checks.registry import CHECKS, ByCase
    for check in CHECKS:
        runs = [run for _, run in check.run.deciders] if isinstance(check.run, ByCase) else [check.run]
        # where each function's source lies, as the interpreter found it (not a spelling of its module's name)
        files = (Path(inspect.getsourcefile(run)).resolve().relative_to(REPO).as_posix() for run in runs)
        assert check.decided_in == tuple(dict.fromkeys(files)), check.id
        assert all((REPO / module).is_file() for module in check.decided_in), check.id
        assert "conformance/checks/registry.py" not in check.decided_in, f"{check.id}: the registry decides nothing"


def test_the_checks_package_table_is_the_registrys():
    """conformance/checks/__init__.py's table: each module with the checks it decides, as the
    registry's decided_in has them (node_loss in both tiers.py and nodes.py)."""
    import conformance.checks as checks
    from conformance.checks.registry import CHECKS
    table = {module: {i.strip() for i in ids.split(",")}
             for module, ids in re.findall(r"^\| (\w+\.py) \| (.+) \|$", checks.__doc__, re.MULTILINE)}
    derived: dict[str, set[str]] = {}
    for check in CHECKS:
        for module in check.decided_in:
            derived.setdefault(module.rsplit("/", 1)[1], set()).add(check.id)
    assert table == derived


def test_by_case_hands_each_kind_of_case_to_its_function():
    from conformance.checks.registry import BY_ID, ByCase
    seen = []
    by_case = ByCase(((int, lambda *a: seen.append(("int", a[-1]))), (object, lambda *a: seen.append(("other", a[-1])))))
    point = CrashPoint.parse("save:6/3")
    by_case(None, "c", None, None, 3)
    by_case(None, "c", None, None, point)
    assert seen == [("int", 3), ("other", point)]
    kinds = [kind for kind, _ in BY_ID["node_loss"].run.deciders]
    assert kinds == [int, object]   # a number: the cold tier; anything else: a node point


def test_the_docs_name_where_each_check_is_decided():
    from conformance.checks.registry import CHECKS
    from conformance.report.checks_page import checks_page, markdown_table
    page = checks_page()
    assert "Decided in `conformance/checks/tiers.py` and `conformance/checks/nodes.py`." in page
    for check in CHECKS:
        assert f"Decided in `{check.decided_in[0]}`" in page
    row = next(r for r in markdown_table().splitlines() if r.startswith("| [`node_loss`]"))
    assert "(docs/checks.md#node_loss)" in row   # the README links to the page that says where


def test_a_trainer_process_stderr_path_has_one_owner(tmp_path):
    from conformance.run import launch
    from conformance.run.runners import rank_stderr_template, stderr_file
    log = tmp_path / "trial-loss.jsonl"
    assert stderr_file(log) == tmp_path / "trial-loss.jsonl.stderr"
    assert rank_stderr_template(log) == tmp_path / "trial-loss.jsonl.stderr.rank{rank}"
    assert launch.rank_stderr(rank_stderr_template(log), 1) == tmp_path / "trial-loss.jsonl.stderr.rank1"
    spelled = [path for path, text in _sources() if re.search(r'\+ "\.stderr', text)]
    assert spelled == ["conformance/run/runners.py"], "ask runners.stderr_file / rank_stderr_template instead"


@pytest.mark.parametrize("value, expected", [("3", 3), ("0", None), (None, None)])
def test_the_state_workers_default_has_one_owner(monkeypatch, value, expected):
    import os

    from conformance.bench import measure
    from conformance.checks import states
    if value is None:
        monkeypatch.delenv("CONFORMANCE_STATE_WORKERS", raising=False)
    else:
        monkeypatch.setenv("CONFORMANCE_STATE_WORKERS", value)
    assert states.state_workers() == (expected or min(4, os.cpu_count() or 1))
    assert measure.state_workers is states.state_workers
    spelled = [path for path, text in _sources() if "CONFORMANCE_STATE_WORKERS" in text]
    assert spelled == ["conformance/checks/states.py"]
