"""atomic_write and remove_stale_temps."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from resume_conformance import reference
from resume_conformance.reference.primitives.atomic import is_temp_name, temp_name_for


def test_atomic_write_returns_size_and_hash_and_leaves_no_temp(tmp_path):
    target = tmp_path / "f.bin"
    data = os.urandom(3 << 20)  # past the coalescing threshold: large writes go straight through
    size, digest = reference.atomic_write(target, lambda sink: [sink.write(data[:10]), sink.write(data[10:])])
    assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())
    assert target.read_bytes() == data
    assert os.listdir(tmp_path) == ["f.bin"]


def test_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path):
    target = tmp_path / "f.bin"
    reference.atomic_write_bytes(target, b"old")

    def fail(sink):
        sink.write(b"new partial")
        raise RuntimeError("writer failed")
    with pytest.raises(RuntimeError):
        reference.atomic_write(target, fail)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_temp_names_are_recognised(tmp_path):
    name = temp_name_for(tmp_path / "step-00000001.pt").name
    assert is_temp_name(name) and name.startswith(".step-00000001.pt.tmp-")
    assert f"-{os.getpid()}-" in name


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-S", "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_remove_stale_temps_removes_only_its_own_dead_temps(tmp_path, dead_pid, live_pid):
    token = "0123456789abcdef"
    stale = [f".step-00000001.pt.tmp-{dead_pid}-{token}", f".index.json.tmp-{dead_pid}-{token}"]
    keep = [
        f".step-00000002.pt.tmp-{live_pid}-{token}",        # a live writer's temp
        f".step-00000003.pt.tmp-{os.getpid()}-{token}",     # our own
        f"step-00000004.pt.tmp-{dead_pid}-{token}",         # no leading dot
        f".x.tmp-{dead_pid}-0123456789ABCDEF",              # token not lowercase hex
        f".x.tmp-{dead_pid}-0123456789abcde",               # token too short
        f".x.tmp-{dead_pid}-{token}0",                      # token too long
        f".x.tmp--{token}",                                 # no pid
        f".x.tmp-١٢٣-{token}",                              # non-ASCII digits
        f".x.tmp-{10**30}-{token}",                         # no such pid can exist
        f".x.tmp-{dead_pid}-{token}.bak",                   # suffix
        f".x.tmp-{dead_pid}-{token}\n",                     # trailing newline
        "step-00000005.pt", "notes.txt", ".hidden",
    ]
    for name in stale + keep:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f".dir.tmp-{dead_pid}-{token}").mkdir()                # a directory, not a file
    os.symlink("notes.txt", tmp_path / f".link.tmp-{dead_pid}-{token}")  # a symlink
    removed = reference.remove_stale_temps(tmp_path)
    assert sorted(p.name for p in removed) == sorted(stale)
    remaining = set(os.listdir(tmp_path))
    assert remaining == set(keep) | {f".dir.tmp-{dead_pid}-{token}", f".link.tmp-{dead_pid}-{token}"}
    assert reference.remove_stale_temps(tmp_path / "missing") == []


def test_saves_and_the_manager_clean_stale_temps(tmp_path, dead_pid):
    token = "fedcba9876543210"
    run = tmp_path / "run"
    run.mkdir()
    (run / f".step-00000001.pt.tmp-{dead_pid}-{token}").write_bytes(b"x")
    manager = reference.CheckpointManager(run, layout="sharded")
    assert os.listdir(run) == []
    from tests.strategies import trainer_payload
    ckpt = run / "step-00000002"
    ckpt.mkdir()
    (ckpt / f".meta.pt.tmp-{dead_pid}-{token}").write_bytes(b"x")
    manager.save(trainer_payload(step=2), step=2, force=True)
    assert not any(is_temp_name(p.name) for p in ckpt.iterdir())
