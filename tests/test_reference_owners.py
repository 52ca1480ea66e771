"""One owner per fact in the reference library, each pinned where its former copies disagreed:

- the checkpoints of a directory: `catalog.list_checkpoints` (the DCP manager's `committed_steps` and the
  node-local manager's `committed_manifests` ask it; the node-local copy followed a link to a directory),
  over the one scan of a directory for step names, `names.step_entries`, which chain's garbage collection
  filters for manifests too;
- the sweep of stale staging directories: `multirank.staging` (the node-local copy failed on a stray file
  under a staging name, the DCP copy reported a file or link removed that it had left);
- a `keep_last` setting: `retention.check_keep_last` (every copy took True as 1 and 2.5 until retention
  crashed on it; the node-local one raised TypeError for None);
- a checkpoint's name -> its layout: `layouts.kinds` (an unknown layout name was a bare KeyError there and
  a message of its own in the config);
- a state as bytes and back: `primitives.encoding`, through `primitives.loading`, the one caller of
  torch.load (the multi-rank managers called it themselves and called torn bytes unsafe).
"""
from __future__ import annotations

import ast
import base64
import json
import os
import re
from pathlib import Path

import pytest
import torch
from resume_conformance.reference import ManagerConfig, names
from resume_conformance.reference.catalog import CheckpointInfo, list_checkpoints
from resume_conformance.reference.chain.write import skeleton_text
from resume_conformance.reference.distributed import DistributedCheckpointManager, committed_steps
from resume_conformance.reference.errors import CorruptCheckpointError, UnsafeCheckpointError
from resume_conformance.reference.layouts import kinds
from resume_conformance.reference.multirank import replicated
from resume_conformance.reference.multirank.staging import fresh_staging, sweep_staging
from resume_conformance.reference.primitives.encoding import from_torch_bytes, torch_bytes
from resume_conformance.reference.retention import check_keep_last

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _replicated_step(directory: Path, step: int, name: str | None = None) -> Path:
    path = directory / (name or names.step_name(step))
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"format": replicated.FORMAT, "step": step, "world_size": 1,
                                                    "local": 1, "files": {}}))
    return path


# -- the checkpoints of a directory -------------------------------------------------------------------
def test_one_listing_of_step_directories_serves_both_multi_rank_managers(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    for step in (2, 99_999_999, 100_000_000):    # 9 digits: before `step-99999999` as a string
        _replicated_step(run, step)
    (run / "step-00000007").write_bytes(b"a file, not a step directory")
    (run / "step-00000009").symlink_to(_replicated_step(elsewhere, 9), target_is_directory=True)
    (run / names.staging_name(5)).mkdir()
    (run / names.step_name(4, "file")).write_bytes(b"")
    expected = [2, 99_999_999, 100_000_000]
    assert [i.step for i in list_checkpoints(run, layout="sharded")] == expected
    assert [i.step for i in list_checkpoints(run)] == [2, 4, 99_999_999, 100_000_000]
    assert committed_steps(run) == [(s, run / names.step_name(s)) for s in reversed(expected)]
    # The node-local manager's own copy followed the link to a directory and counted step 9.
    assert sorted(replicated.committed_manifests(run)) == expected
    assert replicated.committed_manifests(tmp_path / "absent") == {} and committed_steps(tmp_path / "absent") == []


def test_chain_garbage_collection_and_the_catalog_share_one_scan_of_a_directory(tmp_path):
    """Both take names.step_entries' entries in its order; gc keeps only what it can read as a
    file, so a link to a directory under a manifest's name is the catalog's (to verify and skip)
    and not gc's."""
    from resume_conformance.reference.chain import gc
    for step in (100_000_000, 5, 99_999_999):
        (tmp_path / names.step_name(step, "chain")).write_text("{}")
    (tmp_path / "step-7.chain.json").write_text("{}")                 # unpadded: still step 7
    (tmp_path / names.step_name(8, "chain")).mkdir()                  # a directory is no manifest
    (tmp_path / f".{names.step_name(9, 'chain')}.tmp-1-0123456789abcdef").write_text("{}")
    (tmp_path / names.step_name(6)).mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / names.step_name(10, "chain")).symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    listed = [i.path for i in list_checkpoints(tmp_path, layout="chain")]
    assert [names.step_of(p.name) for p in listed] == [5, 7, 10, 99_999_999, 100_000_000]
    assert gc.manifests(tmp_path) == [p for p in listed if names.step_of(p.name) != 10]
    assert gc.manifests(tmp_path / "absent") == [] == names.step_entries(tmp_path / "absent")


def test_only_names_scans_a_directory_for_step_names():
    """A second scan would order or filter on its own (by string, say): ask `names.step_entries`."""
    scanning = sorted(str(path.relative_to(REPO)) for path in (REPO / "reference").rglob("*.py")
                      if re.search(r"(parse|step_of|is_manifest_name)\((e|entry)\.name\)", path.read_text()))
    assert scanning == ["reference/names.py"], scanning


# -- stale staging directories --------------------------------------------------------------------------
def test_the_staging_sweep_removes_what_stands_under_a_staging_name_and_reports_only_that(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"x")
    (run / names.staging_name(1)).mkdir()
    (run / names.staging_name(1) / "rank0.pt").write_bytes(b"torn")
    (run / names.staging_name(2)).write_bytes(b"a stray file")      # rmtree: NotADirectoryError
    (run / names.staging_name(3)).symlink_to(outside, target_is_directory=True)   # rmtree refuses a link
    (run / names.staging_name(6)).mkdir()
    (run / names.step_name(4)).mkdir()
    removed = sweep_staging(run, older_than=5)
    assert sorted(p.name for p in removed) == [names.staging_name(s) for s in (1, 2, 3)]
    assert sorted(p.name for p in run.iterdir()) == sorted([names.staging_name(6), names.step_name(4)])
    assert (outside / "keep.bin").read_bytes() == b"x"               # a link is unlinked, never followed
    assert sweep_staging(run) == [run / names.staging_name(6)] and sweep_staging(run) == []


@pytest.mark.parametrize("left", ["directory", "file", "link"])
def test_a_fresh_staging_directory_replaces_whatever_a_dead_save_left(tmp_path, left):
    staging, outside = tmp_path / names.staging_name(3), tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"x")
    if left == "directory":
        staging.mkdir()
        (staging / "__0_0.distcp").write_bytes(b"half")
    elif left == "file":
        staging.write_bytes(b"stray")
    else:
        staging.symlink_to(outside, target_is_directory=True)
    fresh_staging(staging)
    assert staging.is_dir() and not staging.is_symlink() and not any(staging.iterdir())
    assert (outside / "keep.bin").read_bytes() == b"x"


def test_the_dcp_manager_sweeps_a_stray_staging_file_through_the_owner(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    manager = DistributedCheckpointManager(tmp_path, keep_last=1)
    (tmp_path / names.staging_name(1)).write_bytes(b"a stray file")
    manager.save(3, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == [names.step_name(3)]


# -- keep_last ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("good", [None, 1, 3])
def test_keep_last_none_or_a_positive_integer_is_accepted(good):
    check_keep_last(good)
    assert ManagerConfig(keep_last=good).keep_last == good


@pytest.mark.parametrize("bad", [0, -1, True, False, 2.5, "2"], ids=repr)
def test_every_manager_refuses_the_same_keep_last_with_the_same_message(tmp_path, bad):
    with pytest.raises(ValueError, match="keep_last must be") as owner:
        check_keep_last(bad)
    makers = [lambda: ManagerConfig(keep_last=bad),
              lambda: DistributedCheckpointManager(tmp_path, keep_last=bad),
              lambda: replicated.ReplicatedCheckpointManager(tmp_path, keep_last=bad)]   # before any collective
    for make in makers:
        with pytest.raises(ValueError) as exc:
            make()
        assert str(exc.value) == str(owner.value)


# -- name -> layout -------------------------------------------------------------------------------------
def test_a_listed_checkpoint_has_the_layout_kinds_maps_its_name_to(tmp_path):
    for step, layout in enumerate(names.LAYOUTS, start=1):
        path = tmp_path / names.step_name(step, layout)
        path.mkdir() if kinds.named(layout).is_directory else path.write_bytes(b"")
    listed = list_checkpoints(tmp_path)
    assert [i.layout for i in listed] == list(names.LAYOUTS)
    assert all(kinds.of(i.path) is kinds.named(i.layout) for i in listed)
    for layout in names.LAYOUTS:
        assert [i.layout for i in list_checkpoints(tmp_path, layout=layout)] == [layout]
    assert CheckpointInfo(1, Path("elsewhere/model.pt")).layout == kinds.of("model.pt").name == "file"


@pytest.mark.parametrize("bad", ["bogus", "Sharded", ["file"]], ids=repr)
def test_an_unknown_layout_name_is_refused_in_one_place_with_the_names_there_are(tmp_path, bad):
    with pytest.raises(ValueError, match="layout must be one of 'sharded', 'file', 'chain'") as owner:
        kinds.named(bad)
    for ask in (lambda: ManagerConfig(layout=bad), lambda: list_checkpoints(tmp_path, layout=bad)):
        with pytest.raises(ValueError) as exc:
            ask()
        assert str(exc.value) == str(owner.value)


def _calls(module: str, attribute: str) -> dict[str, list[int]]:
    """The modules of reference/ calling `module.attribute(...)`, with the lines."""
    found: dict[str, list[int]] = {}
    for path in sorted((REPO / "reference").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if (isinstance(func, ast.Attribute) and func.attr == attribute and isinstance(func.value, ast.Name)
                    and func.value.id == module):
                found.setdefault(path.relative_to(REPO).as_posix(), []).append(node.lineno)
    return found


def test_only_kinds_maps_a_name_to_a_layout_and_only_loading_calls_torch_load():
    assert set(_calls("names", "layout_of")) == {"reference/layouts/kinds.py"}
    assert set(_calls("torch", "load")) == {"reference/primitives/loading.py"}


# -- a state as bytes -----------------------------------------------------------------------------------
def test_a_state_round_trips_through_bytes_and_torn_bytes_are_corrupt_not_unsafe(tmp_path):
    state = {"w": torch.arange(4.0), "step": 3, "rng": torch.get_rng_state()}
    blob = torch_bytes(state)
    back = from_torch_bytes(blob, tmp_path / "rank0.pt")
    assert back["step"] == 3 and torch.equal(back["w"], state["w"]) and torch.equal(back["rng"], state["rng"])
    assert skeleton_text({"step": 3}) == base64.b64encode(torch_bytes({"step": 3})).decode("ascii")
    for torn in (blob[: len(blob) // 2], b""):
        with pytest.raises(CorruptCheckpointError, match="rank0.pt"):
            from_torch_bytes(torn, tmp_path / "rank0.pt")
    with pytest.raises(UnsafeCheckpointError):
        from_torch_bytes(torch_bytes({"obj": os.PathLike}), tmp_path / "rank0.pt")


def test_the_old_names_fixtures_import_still_resolve():
    from resume_conformance.reference import distributed
    from resume_conformance.reference.layouts.replicated import ReplicatedCheckpointManager
    assert distributed._torch_bytes is torch_bytes and callable(distributed._load_safe)
    assert ReplicatedCheckpointManager is replicated.ReplicatedCheckpointManager
