"""The cold tier as the suite hands it to a trainer (conformance/run/coldstore.py): every change is
forwarded and recorded with the step logged before it; a kill lands exactly before change N; the
RunSpec puts it in a trainer's environment; and over S3 the loopback server the suite starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from conformance.model.crash import ColdFault
from conformance.model.process import RunSpec, cold_env, cold_log, cold_root
from conformance.run import coldstore

SCRIPT = """
import json, os, fsspec
fs, root = fsspec.url_to_fs(os.environ["CONFORMANCE_COLD_URL"])
log = open(os.environ["CONFORMANCE_LOSS_LOG"], "a")
for step in (1, 2, 3):
    log.write(json.dumps({"step": step, "loss": 0.0}) + "\\n"); log.flush()
    fs.pipe_file(f"{root}/obj-{step}.tmp", b"x" * step)
    fs.mv(f"{root}/obj-{step}.tmp", f"{root}/obj-{step}")
print(sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)))
"""


def _trainer(tmp_path: Path, kill_at: int | None, fault: ColdFault | None = None
             ) -> tuple[subprocess.CompletedProcess, Path]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    spec = RunSpec(3, 1, 0, cold="file", cold_fault=fault or (ColdFault("kill", kill_at) if kill_at else None))
    env = spec.env(ckpt, tmp_path / "loss.jsonl")
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120), ckpt


def test_changes_are_forwarded_and_recorded_with_the_step(tmp_path):
    proc, ckpt = _trainer(tmp_path, None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['obj-1', 'obj-2', 'obj-3']"
    ops = coldstore.read_log(cold_log(ckpt))
    assert [(o.n, o.op, o.after_step) for o in ops] == [(1, "pipe_file", 1), (2, "mv", 1), (3, "pipe_file", 2),
                                                      (4, "mv", 2), (5, "pipe_file", 3), (6, "mv", 3)]
    assert sorted(os.listdir(cold_root("file", ckpt))) == ["obj-1", "obj-2", "obj-3"]


@pytest.mark.parametrize("kill_at", [1, 4, 6])
def test_a_kill_lands_just_before_change_n(tmp_path, kill_at):
    proc, ckpt = _trainer(tmp_path, kill_at)
    assert proc.returncode == -9, proc.stderr
    assert len(coldstore.read_log(cold_log(ckpt))) == kill_at
    done = sorted(os.listdir(cold_root("file", ckpt))) if os.path.isdir(cold_root("file", ckpt)) else []
    finished = (kill_at - 1) // 2           # each object: a write, then a move into place
    assert [n for n in done if ".tmp" not in n] == [f"obj-{i}" for i in range(1, finished + 1)]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_a_garble_corrupts_the_object_change_n_wrote_and_nothing_else(tmp_path, n):
    proc, ckpt = _trainer(tmp_path, None, ColdFault("garble", n))
    assert proc.returncode == 0, proc.stderr
    root = Path(cold_root("file", ckpt))
    # Change 1 writes obj-1.tmp, change 2 moves it to obj-1: garbling either corrupts obj-1.
    garbled = f"obj-{(n + 1) // 2}"
    for step in (1, 2, 3):
        data = (root / f"obj-{step}").read_bytes()
        assert len(data) == step
        assert (data != b"x" * step) == (f"obj-{step}" == garbled), (step, data)


@pytest.mark.parametrize("text, fault", [("kill:3", ColdFault("kill", 3)), ("garble:12", ColdFault("garble", 12))])
def test_a_cold_fault_reads_back_from_its_text(text, fault):
    assert ColdFault.parse(text) == fault and str(fault) == text
    for bad in ("kill", "kill:0", "melt:3", "garble:x"):
        with pytest.raises(ValueError, match="cold fault"):
            ColdFault.parse(bad)


def test_the_environment_names_the_store_and_the_log(tmp_path):
    ckpt = tmp_path / "run" / "ckpt"
    env = cold_env("file", ckpt)
    assert env["CONFORMANCE_COLD_URL"] == f"conformance-cold://{ckpt}.cold"
    assert env["CONFORMANCE_COLD_TARGET"] == "file" and env["CONFORMANCE_COLD_LOG"] == str(cold_log(ckpt))
    s3 = cold_env("s3://bucket/prefix", ckpt)
    assert s3["CONFORMANCE_COLD_URL"].startswith("conformance-cold://bucket/prefix/") and s3["CONFORMANCE_COLD_TARGET"] == "s3"
    assert cold_env("s3://bucket/prefix", ckpt.with_name("other"))["CONFORMANCE_COLD_URL"] != s3["CONFORMANCE_COLD_URL"]
    assert "CONFORMANCE_COLD_URL" not in RunSpec(3, 1, 0).env(ckpt, tmp_path / "l")
    assert RunSpec(3, 1, 0, resume_from=2).env(ckpt, tmp_path / "l")["CONFORMANCE_RESUME_FROM"] == "2"
    garble = RunSpec(3, 1, 0, cold="file", cold_fault=ColdFault("garble", 4)).env(ckpt, tmp_path / "l")
    assert garble["CONFORMANCE_COLD_GARBLE_AT"] == "4" and "CONFORMANCE_COLD_KILL_AT" not in garble


def test_over_s3_through_the_loopback_server(tmp_path, monkeypatch):
    pytest.importorskip("moto")
    server = coldstore.LoopbackS3("s3://suite-bucket/runs")
    try:
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        env = {**RunSpec(3, 1, 0, cold="s3://suite-bucket/runs").env(ckpt, tmp_path / "loss.jsonl")}
        proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "['obj-1', 'obj-2', 'obj-3']"
        fs = fsspec.filesystem("s3", endpoint_url=server.endpoint, key="testing", secret="testing")
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(cold_root("s3://suite-bucket/runs", ckpt))) == \
            ["obj-1", "obj-2", "obj-3"]
        assert json.loads(cold_log(ckpt).read_text().splitlines()[0])["op"] == "pipe_file"
    finally:
        server.stop()
    assert "AWS_ENDPOINT_URL" not in os.environ or os.environ["AWS_ENDPOINT_URL"] != server.endpoint
