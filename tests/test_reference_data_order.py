"""ResumableBatchSampler: a resumed sampler yields exactly the batches an uninterrupted one does."""
from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resume_conformance import reference


def _epochs(sampler, n: int) -> list[list[list[int]]]:
    """The batches of the next `n` epochs (one `for batch in sampler` loop each)."""
    return [[list(b) for b in sampler] for _ in range(n)]


def _through_torch_save(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _resumed_run(num_samples, batch_size, drop_last, shuffle, seed, epochs, cut) -> list[list[int]]:
    """Consume `cut` batches (across epochs), take the state, continue in a new sampler."""
    first = reference.ResumableBatchSampler(num_samples, batch_size, seed=seed, shuffle=shuffle,
                                            drop_last=drop_last)
    flat: list[list[int]] = []
    taken = 0
    state = first.state_dict() if cut == 0 else None
    done_epochs = 0
    while state is None:
        for batch in first:
            flat.append(list(batch))
            taken += 1
            if taken == cut:
                state = first.state_dict()  # mid-epoch, or right after an epoch's last batch
                break
        else:
            done_epochs += 1
            continue
        break
    state = _through_torch_save(state)
    # a different seed: everything needed must come from the state
    second = reference.ResumableBatchSampler(num_samples, batch_size, seed=seed + 1000,
                                             shuffle=shuffle, drop_last=drop_last)
    second.load_state_dict(state)
    while len(flat) < epochs * len(second):
        before = len(flat)
        flat.extend(list(b) for b in second)
        if len(flat) == before:
            break
    return flat


@settings(max_examples=50, deadline=None)
@given(num_samples=st.integers(1, 40), batch_size=st.integers(1, 9), drop_last=st.booleans(),
       shuffle=st.booleans(), seed=st.integers(0, 2**31), data=st.data())
def test_resume_yields_the_same_batches(num_samples, batch_size, drop_last, shuffle, seed, data):
    epochs = 3
    reference_run = reference.ResumableBatchSampler(num_samples, batch_size, seed=seed,
                                                    shuffle=shuffle, drop_last=drop_last)
    per_epoch = len(reference_run)
    expected = [b for epoch in _epochs(reference_run, epochs) for b in epoch]
    assert len(expected) == epochs * per_epoch
    if per_epoch == 0:
        return
    cut = data.draw(st.integers(0, epochs * per_epoch - 1), label="cut")
    assert _resumed_run(num_samples, batch_size, drop_last, shuffle, seed, epochs, cut) == expected


@pytest.mark.parametrize("cut", ["mid-epoch", "epoch-boundary"])
def test_resume_state_positions(cut):
    s = reference.ResumableBatchSampler(40, 8, seed=3)
    it = iter(s)
    for _ in range(2 if cut == "mid-epoch" else 5):
        next(it)
    state = s.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == ((0, 2) if cut == "mid-epoch" else (0, 5))
    r = reference.ResumableBatchSampler(40, 8, seed=99)
    r.load_state_dict(state)
    rest = [list(b) for b in r]
    assert len(rest) == (3 if cut == "mid-epoch" else 5)
    assert r.epoch == (0 if cut == "mid-epoch" else 1)


def test_epochs_differ_and_each_is_a_permutation():
    s = reference.ResumableBatchSampler(20, 4, seed=0)
    e0, e1 = _epochs(s, 2)
    assert e0 != e1
    for epoch in (e0, e1):
        assert sorted(i for b in epoch for i in b) == list(range(20))


def test_drop_last_and_sequential_order():
    s = reference.ResumableBatchSampler(10, 4, seed=0, shuffle=False, drop_last=True)
    assert len(s) == 2 and _epochs(s, 1) == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    t = reference.ResumableBatchSampler(10, 4, seed=0, shuffle=False)
    assert _epochs(t, 1) == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]]


def test_loading_a_state_from_a_different_configuration_is_refused():
    state = reference.ResumableBatchSampler(10, 4, seed=0).state_dict()
    for kw in ({"num_samples": 11, "batch_size": 4}, {"num_samples": 10, "batch_size": 5},
               {"num_samples": 10, "batch_size": 4, "shuffle": False},
               {"num_samples": 10, "batch_size": 4, "drop_last": True}):
        other = reference.ResumableBatchSampler(seed=0, **kw)
        with pytest.raises(ValueError):
            other.load_state_dict(state)


def test_mark_consumed_without_count_on_yield():
    s = reference.ResumableBatchSampler(12, 4, seed=1, count_on_yield=False)
    it = iter(s)
    first = next(it)
    assert s.state_dict()["batches_consumed"] == 0
    s.mark_consumed()
    r = reference.ResumableBatchSampler(12, 4, seed=1, count_on_yield=False)
    r.load_state_dict(s.state_dict())
    rest = list(r)
    assert len(rest) == 2 and first not in rest


@pytest.mark.parametrize("bad", [(-1, 4), (4, 0)])
def test_invalid_arguments(bad):
    with pytest.raises(ValueError):
        reference.ResumableBatchSampler(*bad, seed=0)
