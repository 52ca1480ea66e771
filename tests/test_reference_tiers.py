"""The cold tier (reference/cold/store.py, tiering.py) against a real S3 API (moto on loopback) and
file://: demotion only after a verified upload, node loss, markers, retention over both tiers,
upload errors, and a kill at every operation on the store."""
from __future__ import annotations

import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from resume_conformance import reference
from resume_conformance.reference.cold import store as tiers
from resume_conformance.reference.cold.fs import ColdStorageError

from tests.s3server import moto_s3  # noqa: F401
from tests.strategies import trainer_payload

LAYOUTS = [{"layout": "file"}, {"layout": "sharded"},
           pytest.param({"strategy": "incremental", "full_every": 3, "compression": 1},
                        marks=pytest.mark.needs_extra("compression"))]
LAYOUT_IDS = ["file", "sharded", "chain"]


def _payload(step: int) -> dict:
    payload = trainer_payload(step)
    for i, t in enumerate(payload["model"].values()):
        if t.is_floating_point():
            t.add_(step * 0.01 + i)
    return payload


def _model(payload: dict) -> dict:
    return {k: v.clone() for k, v in payload["model"].items()}


def _same_model(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run(manager, steps) -> dict[int, dict]:
    saved = {}
    for step in steps:
        payload = _payload(step)
        manager.save(payload, step=step, force=True)
        saved[step] = _model(payload)
    manager.wait_tiering()
    return saved


def _hot_steps(directory: Path) -> list[int]:
    return [i.step for i in reference.list_checkpoints(directory)]


def _cold_steps(url: str, **kw) -> list[int]:
    return [c.step for c in tiers.ColdTier(url, **kw).list()]


@pytest.fixture(params=["file", "s3"])
def cold(request, tmp_path):
    """(url, storage_options) of an empty cold location on either filesystem (s3: moto on loopback)."""
    if request.param == "file":
        return f"file://{tmp_path / 'cold'}", None
    s3 = request.getfixturevalue("moto_s3")
    return s3.url(f"run-{time.monotonic_ns()}"), s3.storage_options


@pytest.mark.parametrize("kw", LAYOUTS, ids=LAYOUT_IDS)
def test_demotion_then_node_loss(tmp_path, cold, kw):
    url, opts = cold
    run = tmp_path / "hot"
    manager = reference.CheckpointManager(run, cold=url, storage_options=opts, keep_hot=2, **kw)
    saved = _run(manager, range(1, 7))
    manager.close()
    assert _hot_steps(run)[-2:] == [5, 6]
    if "strategy" not in kw:      # a chain keeps the ancestors of its hot checkpoints hot
        assert _hot_steps(run) == [5, 6]
    assert _cold_steps(url, storage_options=opts) == [1, 2, 3, 4, 5, 6]
    shutil.rmtree(run)                               # the node is lost
    again = reference.CheckpointManager(run, cold=url, storage_options=opts, keep_hot=2, **kw)
    payload = again.load_latest()
    assert payload["counters"]["global_step"] == 6 and _same_model(payload["model"], saved[6])
    meta = again.loaded_meta
    assert meta["lineage"]["id"] == "main@6" and meta["lineage"]["parent"] == "main@5"
    again.close()


@pytest.mark.needs_extra("compression")
def test_each_cold_checkpoint_loads_after_node_loss(tmp_path, cold):
    """Every demoted checkpoint of an incremental chain, alone in the cold tier, loads bit-exact."""
    url, opts = cold
    run = tmp_path / "hot"
    kw = dict(strategy="incremental", full_every=3, compression=1, keep_hot=1)
    manager = reference.CheckpointManager(run, cold=url, storage_options=opts, **kw)
    saved = _run(manager, range(1, 6))
    manager.close()
    tier = tiers.ColdTier(url, storage_options=opts)
    listed = {c.name: c for c in tier.list()}
    assert sorted(c.step for c in listed.values()) == [1, 2, 3, 4, 5]
    for c in listed.values():
        fresh = tmp_path / f"restore-{c.step}"
        for name in reversed(c.needs):
            tier.fetch(listed[name], fresh, "")
        payload = reference.load(fresh / c.name)
        assert _same_model(payload["model"], saved[c.step]), c.name


def test_a_cold_checkpoint_without_its_marker_is_never_loaded(tmp_path, cold):
    url, opts = cold
    run = tmp_path / "hot"
    manager = reference.CheckpointManager(run, cold=url, storage_options=opts, keep_hot=1, layout="sharded")
    saved = _run(manager, range(1, 4))
    manager.close()
    tier = tiers.ColdTier(url, storage_options=opts)
    newest = tier.list()[-1]
    tier.fs.rm_file(newest.marker)                   # its objects are all there; the marker is not
    shutil.rmtree(run)
    again = reference.CheckpointManager(run, cold=url, storage_options=opts, keep_hot=1, layout="sharded")
    payload = again.load_latest()
    assert payload["counters"]["global_step"] == 2 and _same_model(payload["model"], saved[2])
    again.close()


def test_a_damaged_cold_object_is_detected_and_skipped(tmp_path):
    cold_dir = tmp_path / "cold"
    run = tmp_path / "hot"
    manager = reference.CheckpointManager(run, cold=f"file://{cold_dir}", keep_hot=1, layout="file")
    _run(manager, range(1, 4))
    manager.close()
    target = cold_dir / "step-00000003.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40
    target.write_bytes(bytes(data))
    shutil.rmtree(run)
    again = reference.CheckpointManager(run, cold=f"file://{cold_dir}", keep_hot=1, layout="file")
    with pytest.warns(reference.CheckpointSkippedWarning, match="sha256"):
        payload = again.load_latest()
    assert payload["counters"]["global_step"] == 2
    again.close()


@pytest.mark.needs_extra("compression")
def test_retention_over_both_tiers_keeps_shared_pieces(tmp_path, cold):
    url, opts = cold
    run = tmp_path / "hot"
    manager = reference.CheckpointManager(run, cold=url, storage_options=opts, keep_hot=1, keep_last=2,
                                          strategy="incremental", full_every=2, compression=1)
    saved = _run(manager, range(1, 8))
    manager.close()
    cold_steps = _cold_steps(url, storage_options=opts)
    assert cold_steps[-2:] == [6, 7] and len(cold_steps) <= 4      # kept ones and the chain they need
    shutil.rmtree(run)
    again = reference.CheckpointManager(run, cold=url, storage_options=opts, keep_hot=1, keep_last=2,
                                        strategy="incremental", full_every=2, compression=1)
    assert _same_model(again.load_latest()["model"], saved[7])
    again.close()


class FailingPut:
    """Wraps a filesystem; `put_file` fails (EIO) or a read-back returns other bytes."""

    def __init__(self, fs, mode: str):
        self._fs, self.mode = fs, mode

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def put_file(self, lpath, rpath, **kw):
        if self.mode == "eio":
            raise OSError(5, "Input/output error", rpath)
        self._fs.put_file(lpath, rpath, **kw)
        if self.mode == "garble":
            self._fs.pipe_file(rpath, b"garbled")

    def pipe_file(self, path, value, **kw):
        if self.mode == "garble_marker" and tiers.MARKER_SUFFIX in str(path):
            value = value.replace(b'"step"', b'"stop"')     # a flipped bit: no longer a valid marker
        self._fs.pipe_file(path, value, **kw)


@pytest.mark.parametrize("mode", ["eio", "garble"])
def test_an_upload_error_is_raised_and_the_hot_copy_stays(tmp_path, mode):
    run, cold_dir = tmp_path / "hot", tmp_path / "cold"
    manager = reference.CheckpointManager(run, cold=f"file://{cold_dir}", keep_hot=1, layout="file")
    manager.cold.fs = FailingPut(manager.cold.fs, mode)
    manager.save(_payload(1), step=1, force=True)
    expected = ColdStorageError if mode == "eio" else tiers.ColdTierError
    with pytest.raises(expected, match="Input/output|uploaded copy"):   # by the next save, or by wait
        manager.save(_payload(2), step=2, force=True)
        manager.wait_tiering()
    assert _hot_steps(run)[0] == 1                   # nothing verified, nothing demoted
    assert not list(cold_dir.glob(f"*{tiers.MARKER_SUFFIX}"))
    try:
        manager.close()          # a second pass (for step 2's save) may have failed the same way
    except expected:
        pass
    assert not list(cold_dir.glob(f"*{tiers.MARKER_SUFFIX}")) and _hot_steps(run)[0] == 1


def test_a_marker_that_does_not_read_back_keeps_the_hot_copy(tmp_path):
    """The marker is the commit point of the cold copy: a store that corrupts it silently must not
    lead to the hot copy being deleted for it."""
    run, cold_dir = tmp_path / "hot", tmp_path / "cold"
    manager = reference.CheckpointManager(run, cold=f"file://{cold_dir}", keep_hot=1, layout="file")
    manager.cold.fs = FailingPut(manager.cold.fs, "garble_marker")
    manager.save(_payload(1), step=1, force=True)
    with pytest.raises(tiers.ColdTierError, match="marker does not read back"):
        manager.save(_payload(2), step=2, force=True)
        manager.wait_tiering()
    try:
        manager.close()
    except tiers.ColdTierError:
        pass
    hot = _hot_steps(run)      # step 2 too, unless the error was raised before it was saved
    assert hot[0] == 1 and manager.cold.list() == []
    again = reference.CheckpointManager(run, cold=f"file://{cold_dir}", keep_hot=1, layout="file")   # store mended
    again.save(_payload(3), step=3, force=True)
    again.wait_tiering()
    assert [c.step for c in again.cold.list()] == hot + [3] and _hot_steps(run) == [3]
    again.close()


class Killed(BaseException):
    """A process kill at an operation on the store: nothing after it runs."""


class KillAt:
    """Counts the store's mutating operations and 'kills' at number `at`."""

    OPS = ("put_file", "pipe_file", "mv", "rm_file", "rm")

    def __init__(self, fs, at: int | None):
        self._fs, self.at, self.count = fs, at, 0

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if name not in self.OPS:
            return attr

        def op(*args, **kw):
            self.count += 1
            if self.count == self.at:
                raise Killed(f"{name} #{self.count}")
            return attr(*args, **kw)
        return op


def _pass_with_kill(tmp_path: Path, at: int | None, kw: dict) -> tuple[int, dict[int, dict]]:
    run, cold_dir = tmp_path / "hot", tmp_path / "cold"
    manager = reference.CheckpointManager(run, cold=f"file://{cold_dir}", keep_hot=1, keep_last=2, **kw)
    counter = KillAt(manager.cold.fs, at)
    manager.cold.fs = counter
    saved = {}
    try:
        for step in range(1, 5):
            payload = _payload(step)
            manager.save(payload, step=step, force=True)
            saved[step] = _model(payload)
            manager.wait_tiering()
    except Killed:
        pass
    finally:
        manager._tier.shutdown()
    return counter.count, saved


@pytest.mark.parametrize("kw", LAYOUTS, ids=LAYOUT_IDS)
def test_a_kill_at_any_store_operation_leaves_a_loadable_checkpoint(tmp_path, kw):
    """Kill (stop every thread's work) at each mutating call on the store in turn, then resume
    with the hot directory as it was and, separately, after a node loss."""
    total, _ = _pass_with_kill(tmp_path / "count", None, kw)
    assert total > 10
    for at in range(1, total + 1):
        case = tmp_path / f"kill-{at}"
        _, saved = _pass_with_kill(case, at, kw)
        newest = max(saved)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", reference.CheckpointSkippedWarning)
            again = reference.CheckpointManager(case / "hot", cold=f"file://{case / 'cold'}", keep_hot=1, keep_last=2, **kw)
            payload = again.load_latest()
            again.close()
            assert payload is not None and payload["counters"]["global_step"] == newest, at
            assert _same_model(payload["model"], saved[newest]), at
            cold_steps = _cold_steps(f"file://{case / 'cold'}")
            shutil.rmtree(case / "hot")
            lost = reference.CheckpointManager(case / "hot", cold=f"file://{case / 'cold'}", keep_hot=1, keep_last=2, **kw)
            payload = lost.load_latest()
            lost.close()
        if cold_steps:
            assert payload["counters"]["global_step"] == max(cold_steps), at
            assert _same_model(payload["model"], saved[max(cold_steps)]), at
        else:
            assert payload is None, at


@pytest.mark.needs_extra("cold")
def test_bad_urls_fail_fast_with_the_url_named(tmp_path):
    with pytest.raises(ColdStorageError, match="unknown storage scheme"):
        reference.CheckpointManager(tmp_path / "a", cold="nosuchscheme://bucket/x")
    started = time.monotonic()
    with pytest.raises(ColdStorageError, match="127.0.0.1:9"):
        reference.CheckpointManager(tmp_path / "b", cold="s3://bucket/x", cold_timeout_s=2,
                                    storage_options={"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"})
    assert time.monotonic() - started < 30
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="keep_hot"):
            reference.CheckpointManager(tmp_path / "c", cold=f"file://{tmp_path}/cold", keep_hot=bad)
