"""Faults injected at the syscall level with strace, in a real process.

* write(2), fsync(2) and rename(2) failing with ENOSPC or EIO at each call of a save: the save
  raises CheckpointWriteError (typed, naming the error; an OSError too), the previous checkpoint
  still verifies, nothing partial is left at a final name and no temp file remains.
* the same with a multi-threaded sharded save (strace counts `when=` per thread: every worker's
  first write fails).
* SIGKILL at a write, a rename (index.json's temp file included), or an unlink/unlinkat/rmdir of
  retention: afterwards the newest valid checkpoint loads, and the next save cleans up.

strace -e inject is not combined with -P or --seccomp-bpf, which silently disable injection.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from resume_conformance import reference
from resume_conformance.reference.primitives.atomic import is_temp_name

from tests.strategies import trainer_payload

STRACE = shutil.which("strace")
CHILD = Path(__file__).resolve().parent / "fault_child.py"
PAD = 200  # the `when=` of every injection; scenarios pad up to it (see fault_child.py)


@pytest.fixture
def strace():
    """The strace binary, for tests marked needs_strace (the marker skips where it cannot inject)."""
    return STRACE


def _run_plan(tmp_path: Path, injections: list[str], scenarios: list[dict]) -> dict[str, int]:
    plan = tmp_path / "plan.json"
    result = tmp_path / "result.json"
    plan.write_text(json.dumps({"pad_target": PAD, "scenarios": scenarios}))
    # trace only the injected syscalls (injection needs them traced; decoding all is slow)
    traced = sorted({inj.split(":")[0] for inj in injections})
    cmd = [STRACE, "-f", "-qq", "-o", os.devnull, "-e", "trace=" + ",".join(traced)]
    for inj in injections:
        cmd += ["-e", f"inject={inj}"]
    cmd += [sys.executable, "-B", str(CHILD), str(plan), str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and result.exists(), f"fault child failed: {proc.stderr[-3000:]}"
    return json.loads(result.read_text())


def _temps(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if is_temp_name(p.name)]


@functools.cache
def _payload(step: int) -> dict:
    return trainer_payload(step=step)  # saving never mutates a payload: one per step will do


def _prepare(root: Path, layout: str) -> Path:
    """A run directory holding one committed checkpoint, step 1, saved by the manager."""
    run = root / "run"
    manager = reference.CheckpointManager(run, keep_last=1, layout=layout, num_shards=2)
    manager.save(_payload(1), force=True)
    return run


def _series_boundary(results: dict[str, int], ids: list[str]) -> int:
    """Number of leading failures in a series ordered by n; asserts they are followed only by
    successes (the injection hits the n-th call, and late n fall past the end of the save)."""
    codes = [results[i] for i in ids]
    w = next((i for i, c in enumerate(codes) if c == 0), len(codes))
    assert all(c != 0 for c in codes[:w]) and all(c == 0 for c in codes[w:]), dict(zip(ids, codes))
    return w


# -- ENOSPC and EIO at every write(2), fsync(2) and rename(2) of a save ----------------------------

ERROR_SERIES = [
    # (name, action, layout, the n to try). A small save makes one write(2) per file (HashingWriter
    # coalesces), so the late n fall past the end and must succeed.
    ("file", "save_file", "file", {"write": [1, 2, 3], "fsync": [1, 2, 3], "rename": [1, 2]}),
    ("sharded", "save_sharded", "sharded", {"write": [1, 2, 3, 4, 5], "fsync": [1, 2, 3, 4, 5, 6, 7, 8],
                                            "rename": [1, 2, 3, 4, 5]}),
    # the manager's calls after the commit point: the directory's fsync, then retention's
    ("manager", "manager_save", "sharded", {"write": [1, 4, 5], "fsync": [1, 7, 8, 9, 10],
                                            "rename": [1, 4, 5, 6]}),
]
TYPED = {"ENOSPC": 20, "EIO": 21}
COMMITTED = 5


@pytest.mark.needs_strace
@pytest.mark.parametrize("syscall", ["write", "fsync", "rename"])
@pytest.mark.parametrize("error", ["ENOSPC", "EIO"])
def test_every_write_fsync_and_rename_of_a_save_fails_cleanly(strace, tmp_path, syscall, error):
    """Each call of a save failing in turn: the save raises CheckpointWriteError naming the
    error, the previous checkpoint is intact (or, past the commit point, the new one is complete
    and the error says so), and no temp file is left."""
    scenarios = [{"id": "cal", "action": "calibrate", "syscall": syscall, "nth": 3, "scratch": str(tmp_path / "cal")}]
    cases = {}
    for name, action, layout, series in ERROR_SERIES:
        for n in series[syscall]:
            sid = f"{name}-{n}"
            root = tmp_path / sid
            run = _prepare(root, layout)
            target = run / ("step-00000002.pt" if layout == "file" else "step-00000002")
            scenarios.append({"id": sid, "action": action, "layout": layout, "syscall": syscall,
                              "nth": n, "step": 2, "target": str(target), "run_dir": str(run),
                              "keep_last": 1, "workers": 1, "scratch": str(root / "scratch")})
            cases[sid] = (run, target)
    if syscall == "write":   # overwriting an existing single file in place: the old one must survive
        root = tmp_path / "overwrite"
        run = _prepare(root, "file")
        scenarios.append({"id": "overwrite", "action": "save_file", "syscall": "write", "nth": 1, "step": 2,
                          "target": str(run / "step-00000001.pt"), "scratch": str(root / "scratch")})

    results = _run_plan(tmp_path, [f"{syscall}:error={error}:when={PAD}"], scenarios)
    assert results["cal"] == 2, results   # the mechanism: a forked child's n-th call gets the injection

    for sid, (run, target) in cases.items():
        code = results[sid]
        assert code in (0, TYPED[error], TYPED[error] + COMMITTED), (sid, code)   # never an untyped OSError
        previous = run / ("step-00000001.pt" if target.suffix == ".pt" else "step-00000001")
        if code == 0:
            reference.verify(target)
            assert reference.load(target)["counters"]["global_step"] == 2
            continue
        if code == TYPED[error] + COMMITTED:
            # only after the commit point (a directory fsync, or retention): the new one is whole
            assert syscall in ("fsync", "rename") and target.exists(), (sid, sorted(p.name for p in run.iterdir()))
            reference.verify(target)
            assert reference.latest_valid(run).step == 2
        else:
            assert not target.exists(), (sid, sorted(p.name for p in run.iterdir()))
            reference.verify(previous)  # the previous checkpoint is intact
            assert reference.latest_valid(run).step == 1
            assert sorted(p.name for p in run.iterdir()) == [previous.name], sid
        assert _temps(run) == [], (sid, _temps(run))

    # each series: the first W calls fail, the rest succeed; every file needs at least one call
    for name, _action, layout, series in ERROR_SERIES:
        w = _series_boundary(results, [f"{name}-{n}" for n in series[syscall]])
        assert w >= 1 and w < len(series[syscall]), (name, w)
        if syscall != "fsync" or name != "manager":
            files = (2 if syscall == "write" else 1) if layout == "file" else 4   # shards, meta.pt, index.json
            assert series[syscall][w - 1] >= files, (name, w)

    if syscall == "write":
        assert results["overwrite"] == TYPED[error]
        reference.verify(tmp_path / "overwrite" / "run" / "step-00000001.pt")
        assert reference.load(tmp_path / "overwrite" / "run" / "step-00000001.pt")["counters"]["global_step"] == 1
        assert _temps(tmp_path / "overwrite" / "run") == []


@pytest.mark.needs_strace
def test_write_error_in_every_writer_thread(strace, tmp_path):
    """when=1 hits the first write of every thread: all shard writers of a parallel save fail."""
    scenarios, runs = [], {}
    for sid, action in (("threads", "save_sharded"), ("threads-manager", "manager_save")):
        root = tmp_path / sid
        run = _prepare(root, "sharded")
        runs[sid] = run
        scenarios.append({"id": sid, "action": action, "layout": "sharded", "step": 2, "workers": 3,
                          "keep_last": 1, "target": str(run / "step-00000002"), "run_dir": str(run),
                          "scratch": str(root / "scratch")})
    results = _run_plan(tmp_path, ["write:error=ENOSPC:when=1"], scenarios)
    for sid, run in runs.items():
        assert results[sid] == TYPED["ENOSPC"], (sid, results[sid])
        assert sorted(p.name for p in run.iterdir()) == ["step-00000001"], sid
        reference.verify(run / "step-00000001")
        assert _temps(run) == []


# -- SIGKILL ------------------------------------------------------------------------------------------

KILL_SERIES = [
    # during the save, before its commit point (keep_last=1: the previous one is the only one)
    ("sharded", "write", 1), ("sharded", "write", 4),     # a shard's write; index.json's write
    ("sharded", "rename", 1), ("sharded", "rename", 4),   # a shard's rename; index.json's rename
    # retention, after the commit: un-committing (unlink index.json), rmtree, rmdir
    ("sharded", "unlink", 1), ("sharded", "unlinkat", 2), ("sharded", "rmdir", 1),
    ("file", "write", 1), ("file", "write", 2), ("file", "rename", 1), ("file", "unlink", 1),
]


@pytest.mark.needs_strace
def test_killed_during_save_or_retention(strace, tmp_path):
    scenarios, cases = [], {}
    for layout, syscall, n in KILL_SERIES:
        sid = f"{layout}-{syscall}-{n}"
        root = tmp_path / sid
        run = _prepare(root, layout)
        scenarios.append({"id": sid, "action": "manager_save", "layout": layout, "syscall": syscall,
                          "nth": n, "step": 2, "keep_last": 1, "workers": 1, "run_dir": str(run),
                          "scratch": str(root / "scratch")})
        cases[sid] = (run, layout, syscall)
    injections = [f"{s}:signal=KILL:when={PAD}" for s in ("write", "rename", "unlink", "unlinkat", "rmdir")]
    results = _run_plan(tmp_path, injections, scenarios)

    for sid, (run, layout, syscall) in cases.items():
        assert results[sid] == -9, (sid, results[sid])  # the child really died at that call
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", reference.CheckpointSkippedWarning)
            latest = reference.latest_valid(run)
        assert latest is not None, f"{sid}: no valid checkpoint left"
        if syscall in ("unlink", "unlinkat", "rmdir"):
            assert latest.step == 2, sid  # killed in retention: the new one was committed
        else:
            assert latest.step in (1, 2), sid
        assert reference.load(latest.path)["counters"]["global_step"] == latest.step

        # the next run: a fresh manager saves again; stale temps and leftovers are cleaned up
        manager = reference.CheckpointManager(run, keep_last=1, layout=layout, num_shards=2)
        manager.save(_payload(3), force=True)
        names = sorted(p.name for p in run.iterdir())
        assert names == ["step-00000003" + (".pt" if layout == "file" else "")], (sid, names)
        assert _temps(run) == []
        assert manager.load_latest()["counters"]["global_step"] == 3

