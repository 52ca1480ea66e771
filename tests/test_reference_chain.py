"""Chained checkpoints (reference/chain/read.py, codec.py): full, incremental and differential saves,
row deltas, compression, chain verification, retention over chains, async saves, fsck."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resume_conformance import reference
from resume_conformance.reference.__main__ import main as cli_main
from resume_conformance.reference.chain import codec, gc
from resume_conformance.reference.chain import read as chain
from resume_conformance.reference.chain import write as chain_write
from resume_conformance.reference.primitives import tree

from tests.strategies import assert_same, payloads, trainer_payload, truncate

STRATEGIES = ["full", "incremental", "differential"]


class Model(torch.nn.Module):
    """An embedding table (row deltas), a frozen layer (never rewritten) and a trained head."""

    def __init__(self, rows: int = 2000):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(rows, 8)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.head = torch.nn.Linear(8, 1)


def _train(model: Model, step: int) -> None:
    with torch.no_grad():
        model.table.weight[step % model.table.num_embeddings] += 0.5
        model.head.weight.add_(0.01)


def _payload(model: Model, step: int) -> dict:
    return reference.capture(model, global_step=step, loss_history=[0.1 * step])


def _manager(run: Path, **kw) -> reference.CheckpointManager:
    kw.setdefault("keep_last", None)
    return reference.CheckpointManager(run, **kw)


def _save_run(run: Path, steps: int, **kw) -> tuple[reference.CheckpointManager, dict[int, dict]]:
    model, manager, saved = Model(), _manager(run, **kw), {}
    for step in range(1, steps + 1):
        _train(model, step)
        payload = _payload(model, step)
        manager.save(payload, force=True)
        saved[step] = tree.cpu_copy(payload)
    return manager, saved


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("compression", [None, pytest.param(1, marks=pytest.mark.needs_extra("compression"))])
def test_every_checkpoint_of_a_chain_loads_bit_exact(tmp_path, strategy, compression):
    _, saved = _save_run(tmp_path, 7, strategy=strategy, full_every=3, compression=compression)
    for step, payload in saved.items():
        loaded = reference.load(tmp_path / chain.manifest_name(step))
        assert_same(loaded, payload)


def test_kinds_follow_strategy_and_full_every(tmp_path):
    for strategy in STRATEGIES:
        _save_run(tmp_path / strategy, 7, strategy=strategy, full_every=3)
        kinds = [chain.read_manifest(tmp_path / strategy / chain.manifest_name(s))[0] for s in range(1, 8)]
        assert [m["since_full"] for m in kinds] == ([0] * 7 if strategy == "full" else [0, 1, 2, 0, 1, 2, 0])
        parents = [m["parent"] and m["parent"]["name"] for m in kinds]
        if strategy == "incremental":
            assert parents[1:3] == [chain.manifest_name(1), chain.manifest_name(2)]
        elif strategy == "differential":
            assert parents[1:3] == [chain.manifest_name(1), chain.manifest_name(1)]
            assert parents[4:6] == [chain.manifest_name(4)] * 2
        else:
            assert parents == [None] * 7


def test_unchanged_tensors_are_not_rewritten_and_changed_rows_are_written_as_rows(tmp_path):
    manager, _ = _save_run(tmp_path, 2, strategy="incremental")
    manifest = chain.read_manifest(tmp_path / chain.manifest_name(2))[0]
    entries = {e["key"]: e for e in manifest["tensors"]}
    assert "rows" in entries["model/table.weight"]
    assert "rows" not in entries["model/frozen.weight"]
    # The delta wrote the table's changed row, the head and the skeleton, not the frozen layer.
    assert manager.last_save.written_bytes < entries["model/table.weight"]["bytes"] * 0.2


def test_full_saves_rewrite_every_piece(tmp_path):
    manager, _ = _save_run(tmp_path, 2, strategy="full")
    assert manager.last_save.written_bytes >= manager.last_save.listed_bytes


def test_rows_compare_bits_not_values(tmp_path):
    """-0.0 == 0.0 as floats; a row delta that missed the sign would rebuild a different tensor."""
    t = torch.zeros(32, 4)
    manager = _manager(tmp_path, strategy="incremental")
    manager.save({"schema": reference.CURRENT_SCHEMA, "model": {"t": t.clone()}}, step=1, force=True)
    t[3, 1] = -0.0
    t[5] = 1.0
    manager.save({"schema": reference.CURRENT_SCHEMA, "model": {"t": t.clone()}}, step=2, force=True)
    out = reference.load(tmp_path / chain.manifest_name(2))["model"]["t"]
    assert torch.equal(out.view(torch.int32), t.view(torch.int32))


@pytest.mark.needs_extra("compression")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=payloads(), second=payloads(), strategy=st.sampled_from(STRATEGIES), level=st.sampled_from([None, 3]))
def test_arbitrary_payloads_round_trip(tmp_path_factory, first, second, strategy, level):
    run = tmp_path_factory.mktemp("chain")
    manager = _manager(run, strategy=strategy, compression=level)
    manager.save(first, step=1, force=True)
    manager.save(second, step=2, force=True)
    assert_same(reference.load(run / chain.manifest_name(1)), reference.migrate(first))
    assert_same(reference.load(run / chain.manifest_name(2)), reference.migrate(second))


# -- chain safety ----------------------------------------------------------------------------------

def test_missing_parent_is_named_and_load_latest_falls_back(tmp_path):
    manager, saved = _save_run(tmp_path, 5, strategy="incremental", full_every=3)
    (tmp_path / chain.manifest_name(2)).unlink()          # step 3 needs it; 4 is full, 5 needs 4
    with pytest.raises(chain.BrokenChainError, match=r"step-00000002.chain.json.*missing: step-00000003"):
        reference.load(tmp_path / chain.manifest_name(3))
    (tmp_path / chain.manifest_name(4)).unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = _manager(tmp_path, strategy="incremental").load_latest()
    assert loaded["counters"]["global_step"] == 1
    assert any("step-00000005" in str(w.message) for w in caught)


def _two_saves(run: Path, strategy: str) -> Model:
    """Steps 1 (full) and 2 (a delta on 1) saved; returns the model, trained on to step 3."""
    model = Model()
    manager = _manager(run, strategy=strategy)
    manager.save(_payload(model, 1), force=True)
    _train(model, 2)
    manager.save(_payload(model, 2), force=True)
    _train(model, 3)
    return model


def test_a_delta_against_a_replaced_parent_is_refused(tmp_path):
    """The parent's name is right but it is not the checkpoint the delta was taken against."""
    model = _two_saves(tmp_path, "differential")
    _manager(tmp_path / "other", strategy="full").save(_payload(model, 1), force=True)
    os.replace(tmp_path / "other" / chain.manifest_name(1), tmp_path / chain.manifest_name(1))
    for piece in (tmp_path / "other" / "pieces").iterdir():
        os.replace(piece, tmp_path / "pieces" / piece.name)
    reference.load(tmp_path / chain.manifest_name(1))     # the new step 1 is whole by itself
    with pytest.raises(chain.BrokenChainError, match="is not the parent step-00000002.chain.json was saved against"):
        reference.load(tmp_path / chain.manifest_name(2))


def test_rows_applied_to_the_wrong_tensor_fail_the_rebuilt_hash(tmp_path):
    _two_saves(tmp_path, "incremental")
    path = tmp_path / chain.manifest_name(1)
    manifest = json.loads(path.read_text())
    # Point step 1's table at a piece of different content (re-sealed, and step 2's link updated).
    other = next(e for e in manifest["tensors"] if e["key"] == "model/head.weight")
    table = next(e for e in manifest["tensors"] if e["key"] == "model/table.weight")
    table.update(piece=other["piece"], bytes=other["bytes"], shape=[1, 8])
    manifest[chain.CHECKSUM_KEY] = chain.manifest_checksum(manifest)
    body = json.dumps(manifest).encode()
    path.write_bytes(body)
    child_path = tmp_path / chain.manifest_name(2)
    child = json.loads(child_path.read_text())
    child["parent"]["sha256"] = hashlib.sha256(body).hexdigest()
    child[chain.CHECKSUM_KEY] = chain.manifest_checksum(child)
    child_path.write_text(json.dumps(child))
    with pytest.raises(chain.BrokenChainError, match="model/table.weight"):
        reference.load(child_path)


@pytest.mark.parametrize("parent", ["../elsewhere/step-00000001.chain.json", "/tmp/step-00000001.chain.json",
                                    "step-00000001.pt", "sub/step-00000001.chain.json"])
def test_a_parent_outside_the_directory_is_rejected(tmp_path, parent):
    _save_run(tmp_path, 2, strategy="incremental")
    path = tmp_path / chain.manifest_name(2)
    manifest = json.loads(path.read_text())
    manifest["parent"]["name"] = parent
    manifest[chain.CHECKSUM_KEY] = chain.manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(reference.InvalidIndexError, match="not a manifest in this checkpoint directory"):
        reference.load(path)


@pytest.mark.needs_extra("compression")
def test_a_flipped_or_cut_piece_is_caught(tmp_path):
    _save_run(tmp_path, 1, strategy="full", compression=1)
    manifest = chain.read_manifest(tmp_path / chain.manifest_name(1))[0]
    entry = max(manifest["tensors"], key=lambda e: e["bytes"])
    piece = tmp_path / "pieces" / entry["piece"]
    data = piece.read_bytes()
    truncate(piece, len(data) - 5)
    with pytest.raises(reference.CorruptCheckpointError, match="cut short"):
        reference.load(tmp_path / chain.manifest_name(1))
    flipped = bytearray(data)
    flipped[-3] ^= 0x10
    piece.write_bytes(bytes(flipped))
    with pytest.raises(reference.CorruptCheckpointError, match=entry["piece"][:8]):
        reference.load(tmp_path / chain.manifest_name(1))


# -- retention -------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["incremental", "differential"])
def test_retention_keeps_what_a_kept_delta_needs_and_sweeps_the_rest(tmp_path, strategy):
    _save_run(tmp_path, 9, strategy=strategy, full_every=4, keep_last=2)
    # Full checkpoints are 1, 5 and 9; 8 and 9 are kept, and 8 needs its chain back to 5.
    kept = [5, 6, 7, 8, 9] if strategy == "incremental" else [5, 8, 9]
    assert [p.name for p in gc.manifests(tmp_path)] == [chain.manifest_name(s) for s in kept]
    for path in gc.manifests(tmp_path):
        reference.load(path)
    assert gc.orphans(tmp_path) == ([], 0)


def test_retention_never_deletes_the_base_of_a_kept_differential(tmp_path):
    _save_run(tmp_path, 4, strategy="differential", full_every=10, keep_last=1)
    names = sorted(p.name for p in gc.manifests(tmp_path))
    assert names == [chain.manifest_name(1), chain.manifest_name(4)]
    reference.load(tmp_path / chain.manifest_name(4))


class _Crash(BaseException):
    """Stands for the process dying at an operation (the page cache keeps what was done)."""


def _count_ops(monkeypatch, limit: int | None) -> list[int]:
    """Make the `limit`-th mutation (write of a temp file, rename, unlink) raise _Crash."""
    count = [0]
    real_replace, real_unlink = os.replace, os.unlink

    def tick():
        count[0] += 1
        if limit is not None and count[0] == limit:
            raise _Crash()

    def replace(src, dst, *a, **kw):
        tick()
        return real_replace(src, dst, *a, **kw)

    def unlink(path, *a, **kw):
        tick()
        return real_unlink(path, *a, **kw)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    return count


@pytest.mark.parametrize("strategy", ["incremental", "differential"])
def test_a_kill_at_any_operation_of_a_save_or_retention_leaves_kept_checkpoints_loadable(
        tmp_path, monkeypatch, strategy):
    def run(directory: Path, limit: int | None) -> int:
        with monkeypatch.context() as m:
            count = _count_ops(m, limit)
            try:
                _save_run(directory, 6, strategy=strategy, full_every=3, keep_last=1)
            except _Crash:
                pass
        return count[0]

    total = run(tmp_path / "count", None)
    assert total > 20
    for limit in range(1, total + 1):
        directory = tmp_path / f"kill-{limit}"
        run(directory, limit)
        committed = gc.manifests(directory)
        if not committed:
            continue
        newest = max(committed)
        reference.load(newest)                     # the newest committed checkpoint loads
        loaded = _manager(directory, strategy=strategy).load_latest()
        assert loaded is not None and loaded["counters"]["global_step"] == int(newest.name[5:13])


# -- compression -----------------------------------------------------------------------------------

@pytest.mark.needs_extra("compression")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.bool, torch.complex64, torch.uint8])
def test_every_dtype_round_trips_compressed_shuffle_or_not(tmp_path, dtype):
    t = (torch.randn(64, 5) * 3).to(dtype)
    manager = _manager(tmp_path, compression=3)
    manager.save({"schema": reference.CURRENT_SCHEMA, "model": {"t": t}}, step=1, force=True)
    entry = chain.read_manifest(tmp_path / chain.manifest_name(1))[0]["tensors"][0]
    assert entry["codec"] == ("zstd-shuffle" if dtype in codec.SHUFFLE_DTYPES else "zstd")
    assert_same(reference.load(tmp_path / chain.manifest_name(1))["model"]["t"], t)


@pytest.mark.needs_extra("compression")
def test_compressed_and_plain_checkpoints_load_the_same_way(tmp_path):
    payload = trainer_payload(step=3)
    _manager(tmp_path, strategy="full").save(payload, force=True)
    _manager(tmp_path, compression=5).save(trainer_payload(step=4), force=True)
    codecs = {e.get("codec") for s in (3, 4) for e in
              chain.read_manifest(tmp_path / chain.manifest_name(s))[0]["tensors"]}
    assert {"raw", "zstd-shuffle"} <= codecs
    assert_same(reference.load(tmp_path / chain.manifest_name(3)), reference.migrate(payload))


@pytest.mark.needs_extra("compression")
def test_shuffling_helps_trained_looking_floats():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
    raw = memoryview(w.view(torch.uint8).numpy())
    _, shuffled = codec.encode(raw, dtype=w.dtype, compression=codec.Compression(level=3))
    _, plain = codec.encode(raw, dtype=w.dtype, compression=codec.Compression(level=3, shuffle=False))
    assert shuffled["codec"] == "zstd-shuffle" and plain["codec"] == "zstd"
    assert shuffled["stored_bytes"] * 1.05 < plain["stored_bytes"]


def test_a_piece_of_an_unknown_format_version_is_refused(tmp_path):
    blob = b"".join(bytes(p) for p in codec.encode(b"abc")[0])
    bad = blob[:4] + bytes([9]) + blob[5:]
    with pytest.raises(reference.CorruptCheckpointError, match="format version 9"):
        codec.decode(bad, hashlib.sha256(b"abc").hexdigest(), tmp_path / "p")


# -- configuration errors ------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"strategy": "delta"}, "unknown strategy 'delta'"),
    ({"strategy": "incremental", "full_every": 0}, "full_every must be an integer >= 1"),
    ({"strategy": "incremental", "full_every": -2}, "full_every must be an integer >= 1"),
    ({"strategy": "incremental", "full_every": True}, "full_every must be an integer >= 1"),
    ({"strategy": "incremental", "full_every": 2.5}, "full_every must be an integer >= 1"),
    ({"strategy": "incremental", "layout": "file"}, "need the chained layout"),
    ({"compression": 99}, "compression level must be an integer from -7 to 22"),
    ({"compression": "zstd"}, "compression must be a zstd level"),
])
def test_bad_configuration_is_a_clear_error(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        reference.CheckpointManager(tmp_path, **kw)


# -- async saves -----------------------------------------------------------------------------------

def test_async_save_persists_a_copy_and_commits_only_when_done(tmp_path, monkeypatch):
    import threading
    release = threading.Event()
    real = chain_write.save_chain

    def slow(*a, **kw):
        release.wait(10)
        return real(*a, **kw)
    monkeypatch.setattr(chain_write, "save_chain", slow)
    model = Model()
    manager = _manager(tmp_path, strategy="incremental")
    payload = _payload(model, 1)
    expected = tree.cpu_copy(payload)
    path = manager.save(payload, force=True, blocking=False)
    _train(model, 2)                                   # training goes on, in place
    assert manager.latest() is None and not path.exists()
    release.set()
    assert manager.wait() == path
    assert manager.latest().path == path
    assert_same(reference.load(path), expected)


@pytest.mark.parametrize("layout", ["chain", "sharded", "file"])
def test_an_error_in_the_background_is_raised_by_the_next_save_or_wait(tmp_path, monkeypatch, layout):
    manager = _manager(tmp_path, layout=layout)
    manager.save(trainer_payload(step=1), force=True)

    def full_disk(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_disk)
    manager.save(trainer_payload(step=2), force=True, blocking=False)
    with pytest.raises(reference.CheckpointWriteError, match="No space left"):
        manager.wait()
    monkeypatch.undo()
    manager.save(trainer_payload(step=3), force=True, blocking=False)
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(reference.CheckpointWriteError):
        manager.save(trainer_payload(step=4), force=True)   # the step-3 save's error, or its own
    monkeypatch.undo()
    assert manager.latest().step in (1, 3)


def test_a_second_async_save_waits_for_the_first(tmp_path):
    manager = _manager(tmp_path, strategy="differential", keep_last=2)
    for step in range(1, 5):
        manager.save(trainer_payload(step=step), force=True, blocking=False)
    manager.close()
    assert [i.step for i in manager.checkpoints()] == [1, 3, 4]     # 1: the base 3 and 4 need
    assert manager.load_latest()["counters"]["global_step"] == 4


# -- fsck ------------------------------------------------------------------------------------------

def test_fsck_reports_chains_orphans_and_collects_garbage(tmp_path, capsys):
    _save_run(tmp_path, 4, strategy="incremental")
    (tmp_path / "pieces" / ("0" * 64)).write_bytes(b"left by a crashed save")
    assert cli_main(["fsck", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "orphan" in out and "0" * 64 in out
    (tmp_path / chain.manifest_name(2)).unlink()
    assert cli_main(["fsck", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "broken-chain" in out and "missing: step-00000003.chain.json needs it" in out
    assert cli_main(["fsck", "--gc", "--min-age", "0", str(tmp_path)]) == 0
    assert "would remove" in capsys.readouterr().out
    assert (tmp_path / "pieces" / ("0" * 64)).exists()
    assert cli_main(["fsck", "--gc", "--no-dry-run", str(tmp_path)]) == 0
    assert (tmp_path / "pieces" / ("0" * 64)).exists()          # younger than --min-age
    assert cli_main(["fsck", "--gc", "--no-dry-run", "--min-age", "0", str(tmp_path)]) == 0
    assert not (tmp_path / "pieces" / ("0" * 64)).exists()
    reference.load(tmp_path / chain.manifest_name(1))


def test_compression_without_zstandard_is_a_clear_error_at_configuration(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "zstandard", None)      # as if not installed
    with pytest.raises(codec.CompressionUnavailable, match=r"pip install 'resume-conformance\[compression\]'"):
        reference.CheckpointManager(tmp_path, compression=1)
    reference.CheckpointManager(tmp_path, strategy="incremental").save(trainer_payload(step=1), force=True)
