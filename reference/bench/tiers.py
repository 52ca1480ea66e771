"""How long a training step is blocked by a demotion (upload, verify, marker, delete) running in
the background.

    demotion_stall_vs_copy   time the training thread spends blocked because of the cold tier in
                             one step (asking for a pass, and waiting for the store lock that a
                             pass's deletions hold), while the previous checkpoint is uploaded and
                             demoted / time of a plain CPU copy of the state

Each round: a blocking save of the state (the pass for the save before it is still uploading,
verifying and deleting), then a stand-in training step (matrix products for MIN_SAMPLE_S). The
blocked time is measured where it happens (tiering.StoreLock and tiering.Worker count it); the
cold tier is a file:// directory on the same disk, so the upload competes for it too.
"""
from __future__ import annotations

import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..manager import CheckpointManager
from ..state import capture
from .constants import MIN_SAMPLE_S
from .disk import settle
from .workload import build_state


def _train_step(seconds: float) -> None:
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a.T / 256)


def demotion_stall(directory: Path, size_mb: float, repeats: int, log) -> tuple[list[float], dict[str, Any]]:
    state = build_state(size_mb, seed=7)
    run, cold = directory / "tiered", directory / "cold"
    manager = CheckpointManager(run, layout="sharded", keep_last=None, cold=f"file://{cold}", keep_hot=1)
    me = threading.get_ident()
    ratios, blocked, copies, demoted = [], [], [], 0
    manager.save(capture(state, global_step=0), step=0, force=True)
    for r in range(repeats):
        settle(directory)
        t0 = time.perf_counter()
        copy = {k: t.clone() for k, t in state.items()}
        copy_s = time.perf_counter() - t0
        del copy
        before = manager._store_lock.waited_s.get(me, 0.0) + manager._tier.request_s
        manager.save(capture(state, global_step=r + 1), step=r + 1, force=True)
        _train_step(MIN_SAMPLE_S)
        stall = manager._store_lock.waited_s.get(me, 0.0) + manager._tier.request_s - before
        ratios.append(stall / copy_s)
        blocked.append(stall)
        copies.append(copy_s)
        log(f"tiers round {r + 1}/{repeats} blocked {stall * 1e3:.3f} ms, copy {copy_s * 1e3:.1f} ms")
    result = manager.wait_tiering()
    demoted = len(result.demoted) if result else 0
    manager.close()
    uploaded = len(list(cold.glob("*.cold.json")))
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(cold, ignore_errors=True)
    return ratios, {"blocked_ms": statistics.median(blocked) * 1e3, "cpu_copy_s": statistics.median(copies),
                    "uploaded": uploaded, "demoted_in_last_pass": demoted, "step_s": MIN_SAMPLE_S,
                    "shortest_median_s": MIN_SAMPLE_S}
