"""How a chained checkpoint's pieces are written (reference/chain/write.py): prepared on worker
threads ahead of the writes within a bounded window, written in the payload's order, each piece
once, whatever order the workers finish in."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from resume_conformance import reference
from resume_conformance.reference.chain import codec
from resume_conformance.reference.chain import read as chain
from resume_conformance.reference.chain import write as chain_write
from resume_conformance.reference.primitives.schema import CURRENT_SCHEMA


def _record_writes(monkeypatch) -> list[str]:
    """The names of the pieces written, in order."""
    names: list[str] = []
    real = chain_write.atomic_write

    def recording(target, *a, **kw):
        if target.parent == chain.pieces_dir(target.parent.parent):
            names.append(target.name)
        return real(target, *a, **kw)
    monkeypatch.setattr(chain_write, "atomic_write", recording)
    return names


def _jittery_workers(monkeypatch, seed: int) -> None:
    """Encoding takes a random time, so workers finish in a different order each run."""
    rng, lock, real = random.Random(seed), threading.Lock(), codec.encode

    def slow(*a, **kw):
        with lock:
            pause = rng.random() * 0.004
        time.sleep(pause)
        return real(*a, **kw)
    monkeypatch.setattr(codec, "encode", slow)


@pytest.mark.parametrize("seed", range(4))
def test_equal_tensors_are_one_piece_written_once_in_payload_order(tmp_path, monkeypatch, seed):
    zeros = [torch.zeros(64) for _ in range(6)]        # equal bytes, one digest (zero biases alike)
    others = [torch.full((64,), float(i)) for i in range(6)]
    tensors = {f"t{i}": t for i, t in enumerate(v for pair in zip(others, zeros) for v in pair)}
    manager = reference.CheckpointManager(tmp_path / f"run{seed}", strategy="incremental", keep_last=None,
                                          max_workers=3)
    manager.save(reference.capture(torch.nn.Linear(2, 2), global_step=1), step=1, force=True)
    _jittery_workers(monkeypatch, seed)
    names = _record_writes(monkeypatch)
    manager.save(reference.capture(torch.nn.Linear(2, 2), global_step=2, extra={"tensors": tensors}),
                 step=2, force=True)
    pieces = names
    assert len(pieces) == len(set(pieces)), f"a piece was written twice: {pieces}"
    manifest = chain.read_manifest(tmp_path / f"run{seed}" / chain.manifest_name(2))[0]
    first_use = list(dict.fromkeys(e["piece"] for e in manifest["tensors"] if "piece" in e))
    assert pieces == [p for p in first_use if p in pieces], "pieces were not written in the payload's order"
    loaded = reference.load(tmp_path / f"run{seed}" / chain.manifest_name(2))["extra"]["tensors"]
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_workers_run_ahead_of_the_writes_only_within_the_byte_window(tmp_path, monkeypatch):
    piece_bytes = 64 << 10
    monkeypatch.setattr(chain_write, "AHEAD_BYTES", 4 * piece_bytes)
    started, written, worst = [0], [0], [0]
    lock = threading.Lock()
    real_encode, real_write = codec.encode, chain_write.atomic_write

    def encode(raw, **kw):
        with lock:
            started[0] += len(raw)
            worst[0] = max(worst[0], started[0] - written[0])
        return real_encode(raw, **kw)

    def write(target, *a, **kw):
        time.sleep(0.002)                 # a slow disk: the workers would run far ahead if let
        out = real_write(target, *a, **kw)
        with lock:
            written[0] += piece_bytes if target.parent == chain.pieces_dir(tmp_path) else 0
        return out
    monkeypatch.setattr(codec, "encode", encode)
    monkeypatch.setattr(chain_write, "atomic_write", write)
    tensors = {f"t{i}": torch.full((piece_bytes // 4,), float(i)) for i in range(40)}
    workers = 2
    chain_write.save_chain({"schema": CURRENT_SCHEMA, "tensors": tensors}, tmp_path, 1, kind="full",
                           parent=None, max_workers=workers)
    # The window: AHEAD_BYTES of pieces waiting, one more being prepared per worker, one being written.
    assert 2 * piece_bytes <= worst[0] <= 4 * piece_bytes + (workers + 1) * piece_bytes, worst[0]
    assert started[0] == written[0] == 40 * piece_bytes
