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


def _state_tensor(value: Any, what: str) -> torch.Tensor:
    """A generator state must be a 1-D uint8 tensor; converting another dtype would silently
    restore a different state."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        desc = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
            else type(value).__name__
        raise TypeError(f"{what} must be a 1-D uint8 tensor, got {desc}")
    return value.cpu()


def restore_rng(state: dict[str, Any], *, path: str | None = None, strict: bool = True) -> None:
    """Restore all RNGs; any failure raises RNGRestoreError instead of being logged and ignored.

    All or nothing for the host RNGs: a refused state leaves Python's, NumPy's and torch's CPU
    generators as they were."""
    try:
        if not isinstance(state, dict):
            raise TypeError(f"RNG state must be a dict, got {type(state).__name__}")
        py = state["python"]
        gauss_next = py["gauss_next"]
        if gauss_next is not None and (isinstance(gauss_next, bool) or not isinstance(gauss_next, (int, float))):
            raise TypeError(f"python gauss_next must be a float or None, got {type(gauss_next).__name__}")
        py_state = (int(py["version"]), tuple(int(x) for x in py["internal"]), gauss_next)
        npst = state["numpy"]
        key_tensor = npst["key"]
        if not isinstance(key_tensor, torch.Tensor) or key_tensor.dim() != 1:
            raise TypeError(f"numpy key must be a 1-D tensor, got {type(key_tensor).__name__}")
        if key_tensor.is_floating_point() or key_tensor.is_complex() or key_tensor.dtype == torch.bool:
            raise TypeError(f"numpy key must be an integer tensor, got {key_tensor.dtype}")
        key64 = key_tensor.to(torch.int64).cpu().numpy()
        if key64.size != 624 or key64.min() < 0 or key64.max() > 0xFFFFFFFF:
            raise ValueError(f"numpy key must be 624 words in [0, 2**32), got {key64.size} words")
        pos, has_gauss = int(npst["pos"]), int(npst["has_gauss"])
        if not 0 <= pos <= 624 or has_gauss not in (0, 1):
            raise ValueError(f"numpy pos {pos} / has_gauss {has_gauss} out of range")
        np_state = (npst["bit_generator"], np.asarray(key64, dtype=np.uint32), pos, has_gauss,
                    float(npst["cached_gaussian"]))
        cpu_state = _state_tensor(state["torch_cpu"], "torch_cpu")
        cuda_states = state.get("cuda") or []
        if not isinstance(cuda_states, (list, tuple)):
            raise TypeError(f"cuda must be a list of states, got {type(cuda_states).__name__}")
        cuda_states = [_state_tensor(s, f"cuda[{i}]") for i, s in enumerate(cuda_states)]
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError,
            OverflowError) as exc:
        raise RNGRestoreError(path, f"cannot restore RNG state: {exc!r}") from exc
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_states and available != len(cuda_states):
        if strict:
            raise RNGRestoreError(
                path,
                f"checkpoint holds RNG state for {len(cuda_states)} CUDA device(s) but "
                f"{available} are visible; pass strict=False to restore the overlap only")
        cuda_states = cuda_states[:available]
    previous = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu_state)
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError) as exc:
        random.setstate(previous[0])  # all or nothing: put back what was already replaced
        np.random.set_state(previous[1])
        torch.set_rng_state(previous[2])
        raise RNGRestoreError(path, f"cannot restore RNG state: {exc!r}") from exc
    for device, s in enumerate(cuda_states):
        try:
            torch.cuda.set_rng_state(s, device)
        except RuntimeError as exc:
            raise RNGRestoreError(path, f"cannot restore CUDA RNG of device {device}: {exc}") from exc
