"""Shared Hypothesis strategies and comparison helpers for the reference library's tests."""
from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from resume_conformance import reference

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


# -- tensors -----------------------------------------------------------------------------------

def _fill(shape: tuple[int, ...], dtype: torch.dtype, seed: int, special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
        if special and t.numel():
            flat = t.view(-1)
            specials = torch.tensor([math.nan, math.inf, -math.inf, -0.0], dtype=dtype)
            flat[: min(4, flat.numel())] = specials[: min(4, flat.numel())]
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@st.composite
def tensors(draw, *, min_dims: int = 0, max_dims: int = 3, allow_views: bool = True) -> torch.Tensor:
    """Any of DTYPES; 0-d, empty or small shapes; NaN/inf/-0.0 sometimes; sometimes a
    non-contiguous view (transpose, strided slice, offset narrow, expand)."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=min_dims, max_size=max_dims)))
    t = _fill(shape, dtype, draw(st.integers(0, 2**31 - 1)), draw(st.booleans()))
    if allow_views and t.dim() >= 1 and t.numel() > 0:
        kind = draw(st.sampled_from(["none", "transpose", "stride", "narrow", "expand"]))
        if kind == "transpose" and t.dim() >= 2:
            t = t.transpose(0, t.dim() - 1)
        elif kind == "stride":
            t = t[::2]
        elif kind == "narrow" and t.shape[0] > 1:
            t = t.narrow(0, 1, t.shape[0] - 1)
        elif kind == "expand":
            t = t[:1].expand(3, *t.shape[1:])
    return t


param_names = st.one_of(
    st.from_regex(r"[a-z]{1,5}(\.[a-z0-9_]{1,6}){0,3}", fullmatch=True),
    st.text(max_size=8),  # anything: unicode, '/', '..', empty: all must survive a round trip
)


@st.composite
def state_dicts(draw, max_size: int = 6) -> dict[str, torch.Tensor]:
    """A model-like state dict, sometimes with entries sharing storage (views of one tensor)."""
    sd = draw(st.dictionaries(param_names, tensors(), max_size=max_size))
    if draw(st.booleans()):
        base = draw(tensors(min_dims=1, allow_views=False))
        name = draw(param_names)
        sd[name + "#base"] = base
        if base.numel() > 1:
            sd[name + "#tail"] = base[1:]
            sd[name + "#flat"] = base.view(-1)
    return sd


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
)


def nested_state(max_leaves: int = 12):
    """Optimizer-like nested state: dicts keyed by ints or strings, lists, tuples, None, floats,
    ints, bools, strings and small tensors."""
    leaves = st.one_of(scalars, tensors(max_dims=2))
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(st.one_of(st.integers(0, 8), st.text(max_size=5)), children, max_size=3),
        ),
        max_leaves=max_leaves,
    )


@st.composite
def payloads(draw) -> dict[str, Any]:
    """A current-schema payload with arbitrary model and optimizer-like state."""
    payload = {
        "schema": reference.CURRENT_SCHEMA,
        "model": draw(state_dicts()),
        "optimizer": {"state": draw(st.dictionaries(st.integers(0, 5), nested_state(6), max_size=3)),
                      "param_groups": [{"lr": draw(st.floats(0, 1)), "betas": (0.9, 0.999),
                                        "params": draw(st.lists(st.integers(0, 5), max_size=4)),
                                        "foreach": None, "amsgrad": draw(st.booleans())}]},
        "scheduler": draw(st.one_of(st.none(), nested_state(4))),
        "counters": {"global_step": draw(st.integers(0, 10**6)), "epoch": draw(st.integers(0, 50)),
                     "batch_in_epoch": draw(st.integers(0, 50))},
        "loss_history": draw(st.lists(st.floats(allow_nan=False, width=32), max_size=5)),
        "wall_saved_at": draw(st.one_of(st.none(), st.floats(0, 2e9))),
        "extra": draw(st.dictionaries(st.text(max_size=5), nested_state(4), max_size=3)),
    }
    return payload


# -- comparison --------------------------------------------------------------------------------

def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    fresh = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))  # stride 1 always
    return fresh.view(torch.uint8) if t.dtype != torch.uint8 else fresh


def assert_same(actual: Any, expected: Any, where: str = "payload") -> None:
    """Structural, type-exact, bit-exact equality (NaN equals NaN, -0.0 differs from 0.0, a tuple
    differs from a list, dict key order matters; an OrderedDict may come back as a dict)."""
    if not (isinstance(actual, dict) and isinstance(expected, dict)):  # OrderedDict ~ dict
        assert type(actual) is type(expected), f"{where}: type {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        assert torch.equal(_raw_bytes(actual), _raw_bytes(expected)), f"{where}: tensor bytes differ"
    elif isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys()), f"{where}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert repr(actual) == repr(expected), f"{where}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# -- files -------------------------------------------------------------------------------------

def checkpoint_files(path: Path) -> list[Path]:
    """The files of a checkpoint: the file itself, or every file of a sharded directory."""
    path = Path(path)
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    if Path(src).is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)
    return dst


def flip_bit(path: Path, offset: int, bit: int) -> None:
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 1 << bit
    Path(path).write_bytes(bytes(data))


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


# -- a small real training state ---------------------------------------------------------------

def trainer_objects(seed: int = 0, dtype: torch.dtype = torch.float32):
    """The reference trainer's model, optimizer and scheduler, after a few steps (Adam state set)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(16, 1)).to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(3):
        x = torch.randn(8, 6, generator=g, dtype=dtype)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def trainer_payload(step: int = 3, **kw) -> dict[str, Any]:
    model, optimizer, scheduler = trainer_objects()
    return reference.capture(model, optimizer, scheduler, global_step=step, **kw)


class FakeClock:
    """A clock a test moves by hand (`clock.now += 60`): cadences and triggers decide exactly."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- synthetic fault outcomes: checks judged as pure functions ------------------------------------
def judged_fixture():
    """(SPEC, BASELINE, POINT, KILL): a 14-step run saving every 3 steps, a baseline curve, and a
    fault at write #4 of the save of step 9, with the save of step 6 committed before it."""
    from conformance.faults.delivery import PlannedKill
    from conformance.model.crash import CrashPoint
    from conformance.model.process import RunSpec
    point = CrashPoint("save", 9, op=4)
    return (RunSpec(14, 3, 0), {k: 1.0 / k for k in range(1, 15)}, point,
            PlannedKill(point, "write", 12, "write #4 of the save of step 9", 20, 6, 9, 9))


def resumed_curve(baseline: dict[int, float], after: int, *, bent_at: int | None = None) -> dict[int, float]:
    """The baseline's losses after step `after` (a resume from it), off from step `bent_at` on."""
    return {k: v * (2 if bent_at and k >= bent_at else 1) for k, v in baseline.items() if k > after}


def never_plain(step, losses) -> bool:
    """`same_as_plain` for a judge: no plain resume ever matches."""
    return False
