"""Peak extra memory of a save, measured in a fresh child process per variant."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from ..layouts.sharded import save_sharded
from ..layouts.single_file import save_file
from ..state import capture
from .constants import _SAMPLE_S
from .disk import _remove
from .workload import build_state, raw_write, state_bytes, torch_save


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _memory_child(variant: str, size_mb: float, directory: Path) -> dict[str, Any]:
    state = build_state(size_mb)
    payload = capture(state, global_step=1)
    target = directory / f"mem-{variant}"
    run = {"torch_save": lambda: torch_save(payload, target),
           "atomic_save": lambda: save_file(payload, target),
           "sharded_save": lambda: save_sharded(payload, target),
           "raw_write": lambda: raw_write(state, target)}[variant]
    # Warm the code paths on a tiny payload so imports and lazy initialisation are not counted.
    tiny = capture(build_state(0.25, seed=1), global_step=1)
    warm = directory / f"mem-warm-{variant}"
    savers = {"torch_save": torch_save, "atomic_save": save_file, "sharded_save": save_sharded,
              "raw_write": lambda payload, path: raw_write(payload["model"], path)}
    savers[variant](tiny, warm)
    _remove(warm)
    del tiny
    import gc
    gc.collect()
    baseline = _rss_bytes()
    maxrss_before = _maxrss_bytes()
    peak = baseline
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _rss_bytes())
            stop.wait(_SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run()
    finally:
        stop.set()
        sampler.join()
    peak = max(peak, _rss_bytes())
    maxrss_after = _maxrss_bytes()
    if maxrss_after > maxrss_before:  # the kernel's own high-water mark moved during the save
        peak = max(peak, maxrss_after)
    _remove(target)
    nbytes = state_bytes(state)
    return {"variant": variant, "state_bytes": nbytes, "baseline_rss": baseline, "peak_rss": peak,
            "extra_bytes": peak - baseline, "extra_frac": (peak - baseline) / nbytes}


def measure_memory(variant: str, size_mb: float, directory: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "resume_conformance.reference.bench", "--_memory-child", variant,
           "--size-mb", str(size_mb), "--dir", str(directory)]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"memory child for {variant} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the benchmark ---------------------------------------------------------------------------
