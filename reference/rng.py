"""Capture and restore every RNG a training step can consume, in weights_only-safe forms."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .errors import RNGRestoreError


def capture_rng() -> dict[str, Any]:
    """Python, NumPy global, torch CPU and every CUDA device (when CUDA is initialised)."""
    version, internal, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "numpy": {
            "bit_generator": name,
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any], *, path: str | None = None, strict: bool = True) -> None:
    """Restore all RNGs; any failure raises RNGRestoreError instead of being logged and ignored."""
    try:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["internal"]), py["gauss_next"]))
        npst = state["numpy"]
        key = np.asarray(npst["key"].numpy(), dtype=np.uint32)
        np.random.set_state((npst["bit_generator"], key, int(npst["pos"]), int(npst["has_gauss"]),
                             float(npst["cached_gaussian"])))
        torch.set_rng_state(state["torch_cpu"].to(torch.uint8).cpu())
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise RNGRestoreError(path, f"cannot restore RNG state: {exc!r}") from exc
    cuda_states = list(state.get("cuda") or [])
    if not cuda_states:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available != len(cuda_states):
        if strict:
            raise RNGRestoreError(
                path,
                f"checkpoint holds RNG state for {len(cuda_states)} CUDA device(s) but "
                f"{available} are visible; pass strict=False to restore the overlap only")
        cuda_states = cuda_states[:available]
    for device, s in enumerate(cuda_states):
        try:
            torch.cuda.set_rng_state(s.to(torch.uint8).cpu(), device)
        except RuntimeError as exc:
            raise RNGRestoreError(path, f"cannot restore CUDA RNG of device {device}: {exc}") from exc
