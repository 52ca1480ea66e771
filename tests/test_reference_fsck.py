"""`python -m resume_conformance.reference fsck DIR`: one row per checkpoint; exit 0 all valid, 1 any bad, 2 usage."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from resume_conformance import reference
from resume_conformance.reference.__main__ import main as cli_main

from tests.strategies import flip_bit, trainer_payload

ROOT = Path(__file__).resolve().parent.parent


def _rows(out: str) -> dict[str, list[str]]:
    lines = out.strip().splitlines()
    assert lines[0].split() == ["name", "step", "status", "reason"]
    return {line.split()[0]: line.split(None, 3) for line in lines[1:]}


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "run"
    manager = reference.CheckpointManager(run, num_shards=2)
    for step in (1, 2):
        manager.save(trainer_payload(step=step), step=step, force=True)
    reference.save_file(trainer_payload(step=3), run / "step-3.pt")
    return run


def test_all_valid_exits_0(run, capsys):
    assert cli_main(["fsck", str(run)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"step-00000001", "step-00000002", "step-3.pt"}
    assert rows["step-00000002"][1:3] == ["2", "valid"]
    assert rows["step-3.pt"][1:3] == ["3", "valid"]


def test_corrupt_and_incomplete_exit_1_with_reasons(run, capsys):
    flip_bit(run / "step-00000002" / "meta.pt", 200, 4)
    (run / "step-00000001" / "index.json").unlink()
    (run / ".step-4.pt.tmp-999999999-0123456789abcdef").write_bytes(b"partial")
    assert cli_main(["fsck", str(run)]) == 1
    rows = _rows(capsys.readouterr().out)
    assert rows["step-00000001"][2] == "incomplete" and "index.json" in rows["step-00000001"][3]
    assert rows["step-00000002"][2] == "corrupt" and "meta.pt" in rows["step-00000002"][3]
    assert "CorruptCheckpointError" in rows["step-00000002"][3]
    assert rows["step-3.pt"][2] == "valid"
    assert rows[".step-4.pt.tmp-999999999-0123456789abcdef"][2] == "temp"


def test_usage_errors_exit_2(tmp_path, capsys):
    assert cli_main([]) == 2
    assert cli_main(["check", str(tmp_path)]) == 2
    assert cli_main(["fsck"]) == 2
    assert cli_main(["fsck", str(tmp_path / "missing")]) == 2
    (tmp_path / "file").write_text("x")
    assert cli_main(["fsck", str(tmp_path / "file")]) == 2
    assert cli_main(["fsck", str(tmp_path), "extra"]) == 2
    err = capsys.readouterr().err
    assert "usage" in err and "not a directory" in err


def test_nothing_recognizable_exits_3_saying_what_is_there(tmp_path, capsys):
    assert cli_main(["fsck", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "no checkpoints of this library found" in err and "it is empty" in err
    (tmp_path / "last.ckpt").write_bytes(b"another library's file")
    (tmp_path / "checkpoint-500").mkdir()
    assert cli_main(["fsck", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "2 entries this library does not recognize: checkpoint-500, last.ckpt" in err


@pytest.mark.parametrize("args", [["--help"], ["fsck", "--help"]])
def test_help_works_for_the_tool_and_every_command(args):
    proc = _module(*args)
    assert proc.returncode == 0, proc.stderr
    assert "fsck" in proc.stdout and "usage:" in proc.stdout
    if args[0] == "fsck":
        assert "3 no checkpoint" in proc.stdout


def _module(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "resume_conformance.reference", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def test_python_dash_m_reference_fsck(run):
    """The real command line (one interpreter start): rows on stdout, the exit status passed on.
    The other statuses are covered through the same main() in-process above."""
    flip_bit(run / "step-3.pt", 500, 1)
    proc = _module("fsck", str(run))
    assert proc.returncode == 1, proc.stderr
    rows = _rows(proc.stdout)
    assert [rows[n][2] for n in ("step-00000001", "step-00000002", "step-3.pt")] == ["valid", "valid", "corrupt"]
