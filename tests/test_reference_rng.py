"""capture_rng / restore_rng: exact round trip; anything malformed is an RNGRestoreError."""
from __future__ import annotations

import copy
import io
import random

import numpy as np
import pytest
import torch
from resume_conformance import reference


def _draws() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.normal(),
            torch.rand(3).tolist(), torch.randn(2).tolist())


def _through_torch_save(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_round_trip_reproduces_every_generator():
    random.gauss(0, 1)      # leave a cached gaussian in Python's generator
    np.random.normal()      # and possibly in NumPy's
    state = _through_torch_save(reference.capture_rng())
    expected = _draws()
    _draws()                # move everything on
    reference.restore_rng(state)
    assert _draws() == expected


def _malformed():
    good = reference.capture_rng()
    cases = {}

    def case(name, edit):
        s = copy.deepcopy(good)
        edit(s)
        cases[name] = s
    case("not a dict", lambda s: None)
    cases["not a dict"] = ["python", "numpy"]
    case("no python", lambda s: s.pop("python"))
    case("no numpy", lambda s: s.pop("numpy"))
    case("no torch_cpu", lambda s: s.pop("torch_cpu"))
    case("python state too short", lambda s: s["python"].update(internal=s["python"]["internal"][:10]))
    case("python state out of range", lambda s: s["python"].update(
        internal=[2**70] + s["python"]["internal"][1:]))
    case("python gauss_next a string", lambda s: s["python"].update(gauss_next="x"))
    case("numpy key too short", lambda s: s["numpy"].update(key=s["numpy"]["key"][:5]))
    case("numpy key negative", lambda s: s["numpy"]["key"].__setitem__(0, -1))
    case("numpy key too large", lambda s: s["numpy"]["key"].__setitem__(0, 2**40))
    case("numpy key float", lambda s: s["numpy"].update(key=s["numpy"]["key"].double()))
    case("numpy key a list", lambda s: s["numpy"].update(key=s["numpy"]["key"].tolist()))
    case("numpy unknown generator", lambda s: s["numpy"].update(bit_generator="PCG64"))
    case("numpy pos out of range", lambda s: s["numpy"].update(pos=10**6))
    case("torch state float", lambda s: s.update(torch_cpu=s["torch_cpu"].float()))
    case("torch state truncated", lambda s: s.update(torch_cpu=s["torch_cpu"][:100]))
    case("torch state a list", lambda s: s.update(torch_cpu=s["torch_cpu"].tolist()))
    case("cuda not a list", lambda s: s.update(cuda="gpu"))
    case("cuda state float", lambda s: s.update(cuda=[torch.zeros(16)]))
    return cases


MALFORMED = _malformed()


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_state_is_refused_and_changes_nothing(case):
    before = reference.capture_rng()
    with pytest.raises(reference.RNGRestoreError) as info:
        reference.restore_rng(MALFORMED[case], path="/ckpt/step-00000001.pt")
    assert "/ckpt/step-00000001.pt" in str(info.value)
    after = reference.capture_rng()
    assert random.getstate() == (before["python"]["version"], tuple(before["python"]["internal"]),
                                 before["python"]["gauss_next"])
    assert torch.equal(after["torch_cpu"], before["torch_cpu"])
    assert torch.equal(after["numpy"]["key"], before["numpy"]["key"])
    assert after["numpy"]["pos"] == before["numpy"]["pos"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_states_without_cuda():
    state = reference.capture_rng()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]
    before = torch.get_rng_state()
    with pytest.raises(reference.RNGRestoreError, match="2 CUDA device") as info:
        reference.restore_rng(state, path="ckpt.pt", strict=True)
    assert "ckpt.pt" in str(info.value)
    assert torch.equal(torch.get_rng_state(), before)  # refused before touching anything
    expected = _draws_after(state)
    assert expected  # non-strict: the host generators are restored, the CUDA ones skipped


def _draws_after(state):
    reference.restore_rng(state, strict=False)
    first = _draws()
    reference.restore_rng(state, strict=False)
    assert _draws() == first
    return first


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_state_restore_with_cuda_states_is_strict_by_default(tmp_path):
    from tests.strategies import trainer_objects
    model, optimizer, scheduler = trainer_objects()
    payload = reference.capture(model, optimizer, scheduler, global_step=1)
    payload["rng"]["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    path = tmp_path / "step-00000001.pt"
    reference.save_file(payload, path)
    state = reference.TrainState.from_payload(reference.load_file(path), path=str(path))
    with pytest.raises(reference.RNGRestoreError) as info:
        state.restore(model, optimizer, scheduler)
    assert str(path) in str(info.value)
    state.restore(model, optimizer, scheduler, strict_rng=False)
