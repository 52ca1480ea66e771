"""Lineage (reference/lineage.py): ids and parents, branches made by resume_from, retention per
branch, `python -m resume_conformance.reference log`, and save triggers recorded in checkpoints."""
from __future__ import annotations

import json

import pytest
import torch
from resume_conformance import reference
from resume_conformance.reference import lineage
from resume_conformance.reference.__main__ import main as cli_main
from resume_conformance.reference.loop import triggers

from tests.strategies import FakeClock, trainer_payload

LAYOUTS = [{"layout": "file"}, {"layout": "sharded"}, {"strategy": "incremental", "full_every": 3}]
LAYOUT_IDS = ["file", "sharded", "chain"]


def _payload(step: int, line: str = "a") -> dict:
    payload = trainer_payload(step)
    bump = step * 0.01 + (0.5 if line == "b" else 0.0)
    for t in payload["model"].values():
        if t.is_floating_point():
            t.add_(bump)
    return payload


def _steps(directory) -> list[int]:
    return [i.step for i in reference.list_checkpoints(directory)]


def _run(manager, steps, line="a") -> dict[int, dict]:
    saved = {}
    for step in steps:
        payload = _payload(step, line)
        manager.save(payload, step=step, force=True)
        saved[step] = {k: v.clone() for k, v in payload["model"].items()}
    return saved


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kw", LAYOUTS, ids=LAYOUT_IDS)
def test_resume_from_an_older_step_starts_a_branch_and_keeps_the_old_line(tmp_path, kw):
    run = tmp_path / "run"
    main_line = _run(reference.CheckpointManager(run, keep_last=3, **kw), range(1, 7))
    assert _steps(run) == [4, 5, 6]
    manager = reference.CheckpointManager(run, keep_last=3, **kw)
    payload = manager.load(resume_from=4)
    assert payload["counters"]["global_step"] == 4 and manager.branch == "branch-1"
    branch_line = _run(manager, range(5, 10), line="b")
    # The old line: untouched, each checkpoint loads what it held.
    assert _steps(run) == [4, 5, 6]
    for step in (4, 5, 6):
        info = next(i for i in reference.list_checkpoints(run) if i.step == step)
        assert _same(reference.load(info.path)["model"], main_line[step])
    # The branch: its own directory, retention per branch, parent links.
    branch_dir = run / "branches" / "branch-1"
    assert _steps(branch_dir) == ([5, 6, 7, 8, 9] if "strategy" in kw else [7, 8, 9])   # step 7 is a delta on 6 on 5
    metas = {i.step: reference.catalog.read_meta(i) for i in reference.list_checkpoints(branch_dir)}
    assert metas[9]["lineage"] == {"id": "branch-1@9", "parent": "branch-1@8", "run": metas[9]["lineage"]["run"],
                                   "branch": "branch-1"}
    first = reference.catalog.read_meta(reference.list_checkpoints(run)[0])
    assert first["lineage"]["run"] == metas[9]["lineage"]["run"]      # one run, two branches
    # A plain restart continues the branch (HEAD); so does a restart given the same resume_from.
    for again in (lambda m: m.load_latest(), lambda m: m.load(resume_from=4)):
        m = reference.CheckpointManager(run, keep_last=3, **kw)
        got = again(m)
        assert m.branch == "branch-1" and got["counters"]["global_step"] == 9
        assert _same(got["model"], branch_line[9])


def test_branch_lineage_and_log(tmp_path, capsys):
    run = tmp_path / "run"
    _run(reference.CheckpointManager(run, layout="file"), range(1, 5))
    manager = reference.CheckpointManager(run, layout="file")
    manager.load(resume_from=2, branch="spike-fix")
    _run(manager, [3, 4], line="b")
    meta = reference.catalog.read_meta(reference.list_checkpoints(run / "branches" / "spike-fix")[0])
    assert meta["lineage"]["parent"] == "main@2" and meta["lineage"]["id"] == "spike-fix@3"
    assert cli_main(["log", str(run)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].split()[:6] == ["id", "step", "branch", "parent", "tier", "size"]
    rows = {line.split()[0]: line.split() for line in text[1:]}
    assert set(rows) == {"main@1", "main@2", "main@3", "main@4", "spike-fix@3", "spike-fix@4"}
    assert rows["spike-fix@3"][3] == "main@2" and rows["main@3"][3] == "main@2" and rows["main@1"][3] == "-"
    assert "(HEAD)" in text[-1] and text[-1].startswith("spike-fix@4")
    assert cli_main(["log", "--format", "dot", str(run)]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph") and '"main@2" -> "spike-fix@3"' in dot and '"main@2" -> "main@3"' in dot


def test_resume_from_a_missing_step_names_the_steps_there(tmp_path):
    run = tmp_path / "run"
    _run(reference.CheckpointManager(run, layout="file"), [2, 4])
    with pytest.raises(lineage.NoSuchCheckpointError, match=r"resume_from=3.*steps \[2, 4\]"):
        reference.CheckpointManager(run, layout="file").load(resume_from=3)
    assert not (run / "branches").exists() and not (run / lineage.HEAD_NAME).exists()


def test_resume_from_the_newest_makes_no_branch(tmp_path):
    run = tmp_path / "run"
    _run(reference.CheckpointManager(run, layout="file"), [2, 4])
    manager = reference.CheckpointManager(run, layout="file")
    assert manager.load(resume_from=4)["counters"]["global_step"] == 4 and manager.branch == "main"
    assert not (run / "branches").exists()


def test_retention_keeps_branch_points(tmp_path):
    run = tmp_path / "run"
    _run(reference.CheckpointManager(run, layout="file", keep_last=2), range(1, 5))
    manager = reference.CheckpointManager(run, layout="file", keep_last=2)
    manager.load(resume_from=3)
    _run(manager, [4, 5], line="b")
    # Back on main (HEAD moved by hand), main's retention must keep step 3: a branch grows from it.
    lineage.write_head(run, "main")
    main = reference.CheckpointManager(run, layout="file", keep_last=2)
    main.load_latest()
    _run(main, [5, 6, 7])
    assert _steps(run) == [3, 6, 7]


def test_a_half_made_branch_leaves_the_old_line_current(tmp_path):
    """A kill after the branch record but before HEAD moved: a plain restart stays on main."""
    run = tmp_path / "run"
    _run(reference.CheckpointManager(run, layout="file"), range(1, 4))
    lineage.create_branch(run, "main@2")
    manager = reference.CheckpointManager(run, layout="file")
    assert manager.load_latest()["counters"]["global_step"] == 3 and manager.branch == "main"


def test_bad_lineage_input(tmp_path):
    run = tmp_path / "run"
    _run(reference.CheckpointManager(run, layout="file"), range(1, 4))
    manager = reference.CheckpointManager(run, layout="file")
    for bad in ("../x", "a/b", "", "-x", "x" * 65):
        with pytest.raises(ValueError, match="branch name"):
            manager.load(resume_from=2, branch=bad)
    (run / lineage.HEAD_NAME).write_text(json.dumps({"branch": "ghost"}))
    with pytest.raises(reference.InvalidIndexError, match="ghost"):
        reference.CheckpointManager(run, layout="file")


# -- triggers inside the manager ----------------------------------------------------------------

def test_metric_trigger_saves_on_improvement_and_keep_best_survives_rotation(tmp_path):
    run = tmp_path / "run"
    trigger = triggers.any_of(triggers.every_steps(2), triggers.on_metric("val_loss"))
    manager = reference.CheckpointManager(run, layout="file", trigger=trigger, keep_last=2)
    losses = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.8, 5: 0.6, 6: 0.9, 7: 0.95, 8: 0.99}
    saved = [s for s, v in losses.items() if manager.save(_payload(s), step=s, metrics={"val_loss": v})]
    assert saved == [1, 2, 4, 6, 8]
    assert _steps(run) == [2, 6, 8]           # step 2 (0.5) is the best: never rotated away
    meta = reference.catalog.read_meta(reference.list_checkpoints(run)[0])
    assert meta["trigger"]["best"] and meta["metric"] == 0.5
    assert any("val_loss" in r for r in meta["trigger"]["reasons"])


def test_time_trigger_state_survives_a_resume(tmp_path):
    run = tmp_path / "run"
    clock = FakeClock()
    manager = reference.CheckpointManager(run, layout="file", trigger=triggers.every_seconds(100, clock=clock))
    decisions = []
    for step in range(1, 5):
        clock.now += 40
        decisions.append(manager.save(_payload(step), step=step) is not None)
    assert decisions == [False, False, True, False]        # 120 s since start at step 3
    clock.now += 40                                         # the process dies; 40 s pass
    again = reference.CheckpointManager(run, layout="file", trigger=triggers.every_seconds(100, clock=clock))
    again.load_latest()
    # Uninterrupted, the next save is due at step 3's time + 100 s: not at +80 s, at +120 s.
    assert again.save(_payload(4), step=4) is None
    clock.now += 40
    assert again.save(_payload(5), step=5) is not None


def test_a_changed_trigger_is_not_restored(tmp_path):
    run = tmp_path / "run"
    reference.CheckpointManager(run, layout="file", every_steps=2).save(_payload(2), step=2)
    again = reference.CheckpointManager(run, layout="file", trigger=triggers.on_metric("val_loss"))
    with pytest.warns(reference.manager.TriggerChangedWarning, match="every_steps"):
        again.load_latest()
