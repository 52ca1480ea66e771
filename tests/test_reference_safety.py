"""Loading never runs code: a pickle whose __reduce__ would run a command is refused, as a
single file or as meta.pt / a shard with a correctly recomputed hash in index.json."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shlex
import warnings
from pathlib import Path

import pytest
import torch
from resume_conformance import reference
from resume_conformance.reference.layouts.index import encode_index
from resume_conformance.reference.layouts.single_file import _write_with_checksum
from resume_conformance.reference.primitives.atomic import atomic_write

from tests.strategies import trainer_payload

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")


class Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _evil_payload(marker: Path) -> dict:
    payload = trainer_payload(step=1)
    payload["extra"] = {"innocent": 1.0, "exploit": Exploit(marker)}
    return payload


def _refused(path: Path, marker: Path, named: Path) -> None:
    with pytest.raises(reference.UnsafeCheckpointError) as info:
        reference.load(path)
    assert str(named) in str(info.value)
    assert not marker.exists(), "the exploit ran"


def test_exploit_is_real(tmp_path):
    """Guard against a vacuous test: unpickled without weights_only, the exploit does run."""
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(Exploit(marker)))
    assert marker.exists()


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
@pytest.mark.parametrize("form", ["torch.save", "torch.save+checksum", "raw pickle"])
def test_single_file(tmp_path, protocol, form):
    marker = tmp_path / "marker"
    path = tmp_path / "step-00000001.pt"
    payload = _evil_payload(marker)
    if form == "torch.save":
        torch.save(payload, path, pickle_protocol=protocol)
    elif form == "torch.save+checksum":  # passes the whole-file checksum: only unpickling refuses
        atomic_write(path, lambda sink: _write_with_checksum(payload, sink))
    else:
        path.write_bytes(pickle.dumps(payload, protocol=protocol))
    _refused(path, marker, path)
    # also through the manager and fsck paths
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reference.CheckpointSkippedWarning)
        assert reference.latest_valid(tmp_path) is None
        assert reference.CheckpointManager(tmp_path).load_latest() is None
    assert not marker.exists()


@pytest.mark.parametrize("victim", ["meta.pt", "shard"])
@pytest.mark.parametrize("protocol", [2, 4])
def test_sharded_file_with_recomputed_hash(tmp_path, victim, protocol):
    marker = tmp_path / "marker"
    ckpt = tmp_path / "step-00000001"
    reference.save_sharded(trainer_payload(step=1), ckpt, num_shards=2)
    index = json.loads((ckpt / "index.json").read_text())
    entry = next(f for f in index["files"] if (f["name"] == "meta.pt") == (victim == "meta.pt"))
    target = ckpt / entry["name"]
    original = torch.load(target, weights_only=True)
    if victim == "meta.pt":
        original["extra"] = {"exploit": Exploit(marker)}
    else:
        original[entry["keys"][0]] = Exploit(marker)
    torch.save(original, target, pickle_protocol=protocol)
    data = target.read_bytes()
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / "index.json").write_bytes(encode_index(index))  # re-sealed: index and hashes all valid
    reference.verify(ckpt)  # integrity alone cannot tell: the bytes are exactly as listed
    _refused(ckpt, marker, target)
    from resume_conformance.reference.cli.fsck import scan
    rows = scan(tmp_path)
    assert rows[0][2] == "corrupt" and "UnsafeCheckpointError" in rows[0][3]
    assert not marker.exists()


def test_unsafe_error_is_a_checkpoint_error():
    assert issubclass(reference.UnsafeCheckpointError, reference.CheckpointError)
