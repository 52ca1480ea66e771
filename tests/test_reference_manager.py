"""CheckpointManager: cadence, retention, and finding the newest valid checkpoint."""
from __future__ import annotations

import functools
import shutil
import warnings
from pathlib import Path

import pytest
import resume_conformance.reference.catalog as catalog_module  # retention removes through catalog.remove_checkpoints
from resume_conformance import reference

from tests.strategies import FakeClock, flip_bit, trainer_payload


@functools.cache
def _payload(step: int) -> dict:
    return trainer_payload(step=step)


def _steps(run: Path) -> list[int]:
    return [info.step for info in reference.list_checkpoints(run)]


def _valid_steps(run: Path) -> list[int]:
    out = []
    for info in reference.list_checkpoints(run):
        try:
            reference.verify(info)
            out.append(info.step)
        except reference.CheckpointError:
            pass
    return out


# -- cadence ------------------------------------------------------------------------------------------

def test_cadence_every_n_steps(tmp_path):
    manager = reference.CheckpointManager(tmp_path, every_steps=3, clock=FakeClock())
    saved = [step for step in range(1, 11) if manager.save(_payload(step), step=step)]
    assert saved == [3, 6, 9]
    assert _steps(tmp_path) == [3, 6, 9]


def test_cadence_every_t_seconds_with_a_fake_clock(tmp_path):
    clock = FakeClock()
    manager = reference.CheckpointManager(tmp_path, every_seconds=60, clock=clock, layout="file")
    saved = []
    for step in range(1, 9):
        clock.now += 25  # 25 s per step: due at 60 s, i.e. every third step after the last save
        if manager.save(_payload(step), step=step):
            saved.append(step)
    assert saved == [3, 6]


def test_cadence_whichever_comes_first(tmp_path):
    clock = FakeClock()
    manager = reference.CheckpointManager(tmp_path, every_steps=5, every_seconds=100, clock=clock,
                                          layout="file")
    decisions = {}
    for step, advance in [(1, 10), (2, 95), (3, 10), (4, 10), (5, 1), (6, 1), (7, 99), (8, 1)]:
        clock.now += advance
        decisions[step] = manager.save(_payload(step), step=step) is not None
    # step 2: 105 s since start (time); step 5: the step count (and resets the clock);
    # step 7: 100 s after step 5's save (1 + 99), not earlier
    assert [s for s, d in decisions.items() if d] == [2, 5, 7]


def test_force_saves_off_cadence(tmp_path):
    manager = reference.CheckpointManager(tmp_path, every_steps=100, clock=FakeClock())
    assert manager.save(_payload(7), step=7) is None
    path = manager.save(_payload(7), step=7, force=True)
    assert path is not None and path.name == "step-00000007"
    assert reference.load(path)["counters"]["global_step"] == 7


def test_step_defaults_to_the_payload_counter_and_must_be_non_negative(tmp_path):
    manager = reference.CheckpointManager(tmp_path, every_steps=1)
    assert manager.save(_payload(4)).name == "step-00000004"
    with pytest.raises(ValueError):
        manager.save(_payload(4), step=-1, force=True)


def test_invalid_manager_arguments(tmp_path):
    for kw in ({"layout": "zip"}, {"keep_last": 0}, {"best_mode": "median"}):
        with pytest.raises(ValueError):
            reference.CheckpointManager(tmp_path, **kw)
    manager = reference.CheckpointManager(tmp_path)
    with pytest.raises(ValueError):
        manager.save(_payload(1), force=True, metric=float("nan"))


def test_options_are_one_validated_config_given_as_keywords_or_as_a_record(tmp_path):
    config = reference.ManagerConfig(every_steps=2, keep_last=1, layout="file")
    by_record = reference.CheckpointManager(tmp_path / "a", config)
    by_keywords = reference.CheckpointManager(tmp_path / "b", every_steps=2, keep_last=1, layout="file")
    assert by_record.config == by_keywords.config == config
    for manager in (by_record, by_keywords):
        for step in range(1, 7):
            manager.save(_payload(step), step=step)
        assert [(i.step, i.path.name) for i in manager.checkpoints()] == [(6, "step-00000006.pt")]
    assert reference.ManagerConfig(strategy="incremental").layout == "chain"
    with pytest.raises(TypeError, match="either a ManagerConfig or keyword options"):
        reference.CheckpointManager(tmp_path / "c", config, keep_last=2)
    with pytest.raises(TypeError, match="keep_lats"):
        reference.CheckpointManager(tmp_path / "d", keep_lats=2)
    for bad, message in (({"full_every": 0}, "full_every must be an integer >= 1"),
                         ({"strategy": "weekly"}, "unknown strategy 'weekly'"),
                         ({"compression": 3, "layout": "file"}, "need the chained layout"),
                         ({"keep_hot": True}, "keep_hot must be an integer >= 1"),
                         ({"trigger": reference.every_steps(2), "every_steps": 3}, "not both")):
        with pytest.raises(ValueError, match=message):
            reference.ManagerConfig(**bad)
    assert not (tmp_path / "e").exists()


# -- ordering and latest() ------------------------------------------------------------------------------

def test_ordering_is_by_step_number_not_by_name(tmp_path):
    for step in (9, 10, 100, 2):
        reference.save_file(_payload(step), tmp_path / f"step-{step}.pt")  # no zero padding
    reference.save_sharded(_payload(11), tmp_path / "step-11")
    (tmp_path / "step-x.pt").write_bytes(b"not a checkpoint name")
    (tmp_path / "notes.txt").write_text("ignored")
    assert _steps(tmp_path) == [2, 9, 10, 11, 100]
    assert reference.latest_valid(tmp_path).step == 100
    reference.CheckpointManager(tmp_path, keep_last=2, layout="file").apply_retention()
    assert _steps(tmp_path) == [11, 100]


def test_latest_skips_corrupt_and_incomplete_newer_ones_with_warnings(tmp_path):
    manager = reference.CheckpointManager(tmp_path, num_shards=2)
    for step in (1, 2, 3, 4):
        manager.save(_payload(step), step=step, force=True)
    shard = tmp_path / "step-00000004" / "model-00000-of-00002.pt"
    flip_bit(shard, 100, 0)                                         # corrupt
    (tmp_path / "step-00000003" / "index.json").unlink()           # incomplete
    reference.save_file(_payload(5), tmp_path / "step-00000005.pt")
    (tmp_path / "step-00000005.pt").write_bytes(b"")                # empty file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = manager.latest()
    assert latest.step == 2
    skipped = [str(w.message) for w in caught if w.category is reference.CheckpointSkippedWarning]
    assert len(skipped) == 3
    assert "step-00000005.pt" in skipped[0]
    assert "step-00000004" in skipped[1] and shard.name in skipped[1]
    assert "step-00000003" in skipped[2] and "index.json" in skipped[2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        payload = manager.load_latest()
    assert payload["counters"]["global_step"] == 2
    skipped = [str(w.message) for w in caught if w.category is reference.CheckpointSkippedWarning]
    assert len(skipped) == 3 and "step-00000004" in skipped[1]


def test_latest_of_an_empty_or_missing_directory(tmp_path):
    assert reference.latest_valid(tmp_path) is None
    assert reference.latest_valid(tmp_path / "nope") is None
    assert reference.CheckpointManager(tmp_path / "run").load_latest() is None


# -- retention ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["sharded", "file"])
def test_keep_last(tmp_path, layout):
    manager = reference.CheckpointManager(tmp_path, keep_last=2, layout=layout)
    for step in (8, 9, 10, 11):
        manager.save(_payload(step), step=step, force=True)
        assert _valid_steps(tmp_path) == _steps(tmp_path)
    assert _steps(tmp_path) == [10, 11]


@pytest.mark.parametrize("mode,expected", [("min", [2, 5, 6]), ("max", [3, 4, 6])])
def test_keep_best_by_metric(tmp_path, mode, expected):
    manager = reference.CheckpointManager(tmp_path, keep_last=1, keep_best=2, best_mode=mode)
    metrics = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.7, 5: 0.2, 6: 0.6}
    for step, metric in metrics.items():
        manager.save(_payload(step), step=step, metric=metric, force=True)
    assert _steps(tmp_path) == expected  # the best two, plus the newest


def test_keep_best_alone_still_deletes(tmp_path):
    """keep_best without keep_last keeps the best K and the newest, not everything."""
    manager = reference.CheckpointManager(tmp_path, keep_best=1, best_mode="max", layout="file")
    for step, metric in {1: 3.0, 2: 1.0, 3: 2.0, 4: 0.0}.items():
        manager.save(_payload(step), step=step, metric=metric, force=True)
    assert _steps(tmp_path) == [1, 4]


def test_retention_never_deletes_the_checkpoint_just_saved(tmp_path):
    """A stale newer checkpoint (e.g. corrupt, from an earlier run that went further) must not
    take the last kept slot: with keep_last=1 that would delete the only loadable one."""
    manager = reference.CheckpointManager(tmp_path, keep_last=1, num_shards=2)
    manager.save(_payload(20), step=20, force=True)
    shard = tmp_path / "step-00000020" / "model-00001-of-00002.pt"
    flip_bit(shard, 50, 1)  # same size: looks committed to the cheap retention check
    with pytest.warns(reference.CheckpointSkippedWarning):
        assert manager.latest() is None
    path = manager.save(_payload(10), step=10, force=True)
    assert path.exists()
    with pytest.warns(reference.CheckpointSkippedWarning):
        assert manager.latest().step == 10
    assert reference.load(path)["counters"]["global_step"] == 10


def test_retention_without_a_fresh_save_keeps_the_newest_that_verifies(tmp_path):
    manager = reference.CheckpointManager(tmp_path, num_shards=2)
    for step in (1, 2, 3):
        manager.save(_payload(step), step=step, force=True)
    flip_bit(tmp_path / "step-00000003" / "meta.pt", 10, 2)
    removed = reference.CheckpointManager(tmp_path, keep_last=1).apply_retention()
    assert [p.name for p in removed] == ["step-00000001"]
    assert _valid_steps(tmp_path) == [2]


def test_retention_deletes_only_after_commit(tmp_path, monkeypatch):
    """If the save fails, retention never runs: the old checkpoints all stay."""
    manager = reference.CheckpointManager(tmp_path, keep_last=1, num_shards=2)
    manager.save(_payload(1), step=1, force=True)

    def failing_index_write(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("resume_conformance.reference.layouts.sharded.atomic_write_bytes", failing_index_write)
    with pytest.raises(OSError):
        manager.save(_payload(2), step=2, force=True)
    monkeypatch.undo()
    assert _steps(tmp_path) == [1] and _valid_steps(tmp_path) == [1]


def test_incomplete_older_checkpoints_are_removed_newer_ones_kept(tmp_path):
    manager = reference.CheckpointManager(tmp_path, keep_last=1, num_shards=2)
    for step in (1, 2):
        manager.save(_payload(step), step=step, force=True)
    shutil.copytree(tmp_path / "step-00000002", tmp_path / "step-00000001")
    (tmp_path / "step-00000001" / "index.json").unlink()
    (tmp_path / "step-00000009").mkdir()  # a newer incomplete one (maybe being written)
    manager.save(_payload(3), step=3, force=True)
    assert _steps(tmp_path) == [3, 9]


@pytest.mark.parametrize("fail_after", [0, 1, 2])
def test_crash_between_commit_and_deletion(tmp_path, monkeypatch, fail_after):
    """Retention dies partway through deleting an old checkpoint (after unlinking index.json,
    after some shards): the new checkpoint is the valid newest, and the next save cleans up."""
    manager = reference.CheckpointManager(tmp_path, keep_last=1, num_shards=2)
    manager.save(_payload(1), step=1, force=True)
    real_remove = catalog_module.remove_checkpoint

    def dying_remove(path: Path):
        index = path / "index.json"
        index.unlink()
        for shard in sorted(path.glob("model-*.pt"))[:fail_after]:
            shard.unlink()
        raise KeyboardInterrupt("killed during retention")
    monkeypatch.setattr(catalog_module, "remove_checkpoint", dying_remove)
    with pytest.raises(KeyboardInterrupt):
        manager.save(_payload(2), step=2, force=True)
    monkeypatch.setattr(catalog_module, "remove_checkpoint", real_remove)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reference.CheckpointSkippedWarning)
        assert reference.latest_valid(tmp_path).step == 2
        assert reference.CheckpointManager(tmp_path).load_latest()["counters"]["global_step"] == 2
    assert _steps(tmp_path) == [1, 2]  # the half-deleted one is still listed, as incomplete
    reference.CheckpointManager(tmp_path, keep_last=1, num_shards=2).save(_payload(3), step=3, force=True)
    assert _steps(tmp_path) == [3]


def test_crash_during_save_with_keep_last_1(tmp_path, monkeypatch):
    """The save dies after writing shards but before index.json (in-process variant of the
    strace kill tests): the previous checkpoint remains the valid newest."""
    manager = reference.CheckpointManager(tmp_path, keep_last=1, num_shards=2)
    manager.save(_payload(1), step=1, force=True)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the commit point")
    monkeypatch.setattr("resume_conformance.reference.layouts.sharded.atomic_write_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        manager.save(_payload(2), step=2, force=True)
    monkeypatch.undo()
    assert reference.latest_valid(tmp_path).step == 1
    assert manager.load_latest()["counters"]["global_step"] == 1
    # a failed (not killed) save cleans up after itself: nothing at step-00000002
    assert _steps(tmp_path) == [1]


def test_one_module_formats_and_parses_checkpoint_names():
    from resume_conformance.reference import names
    for layout in ("sharded", "file", "chain"):
        for step in (0, 7, 12, 10**9):
            assert names.parse(names.step_name(step, layout)) == (step, layout)
            assert names.step_of(names.step_name(step, layout)) == step
            assert names.layout_of(names.step_name(step, layout)) == layout
    assert names.staging_step(names.staging_name(42)) == 42 and names.staging_step("step-00000042") is None
    for other in ("step-", "step-12.tmp", "Step-12", "step-12.pt.tmp-1-ab", ".step-12", "step-1e3", "step-١٢"):
        assert names.parse(other) is None, other
    with pytest.raises(ValueError, match="not a step-named checkpoint"):
        names.step_of("latest")


def test_checkpoints_are_ordered_by_step_number_not_by_name(tmp_path):
    """A step past eight digits names a longer string that sorts before shorter ones."""
    from resume_conformance.reference import names
    from resume_conformance.reference.catalog import list_checkpoints
    from resume_conformance.reference.chain import gc
    for step in (99_999_999, 100_000_000, 5):
        (tmp_path / names.step_name(step, "file")).write_bytes(b"x")
        (tmp_path / names.step_name(step, "chain")).write_bytes(b"{}")
    assert [i.step for i in list_checkpoints(tmp_path) if i.layout == "file"] == [5, 99_999_999, 100_000_000]
    assert [names.step_of(p.name) for p in gc.manifests(tmp_path)] == [5, 99_999_999, 100_000_000]
