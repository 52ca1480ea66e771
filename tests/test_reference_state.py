"""capture -> save -> load -> TrainState.from_payload -> restore: training continues identically."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from resume_conformance import reference

from tests.strategies import trainer_objects


def _train(model, optimizer, scheduler, sampler, x, y, steps: int) -> list[float]:
    """The reference trainer's step: dropout (torch RNG), input noise (NumPy), target jitter
    (Python random), shuffled resumable batches."""
    losses = []
    while len(losses) < steps:
        for batch in sampler:
            model.train()
            xb = x[batch] + torch.from_numpy(np.random.normal(0, 0.05, (len(batch), 6))).float()
            target = y[batch] * (1.0 + 0.01 * random.random())
            loss = torch.nn.functional.mse_loss(model(xb).squeeze(1), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_restore_continues_training_bit_exactly(tmp_path, layout):
    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(40, 6, generator=g), torch.randn(40, generator=g)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    model, optimizer, scheduler = trainer_objects(seed=0)
    sampler = reference.ResumableBatchSampler(40, 8, seed=1)
    history = _train(model, optimizer, scheduler, sampler, x, y, 7)  # stops mid-epoch

    payload = reference.capture(model, optimizer, scheduler, global_step=7, epoch=sampler.epoch,
                                batch_in_epoch=sampler.batches_consumed, loss_history=history,
                                data_order=sampler.state_dict(), extra={"note": "mid-epoch"})
    saved_model = {k: v.clone() for k, v in payload["model"].items()}  # capture does not copy
    path = tmp_path / ("step-00000007.pt" if layout == "file" else "step-00000007")
    (reference.save_file if layout == "file" else reference.save_sharded)(payload, path)
    expected = _train(model, optimizer, scheduler, sampler, x, y, 9)  # the uninterrupted run

    # a fresh process would start from different objects and RNG states
    random.seed(42), np.random.seed(42), torch.manual_seed(42)
    model2, optimizer2, scheduler2 = trainer_objects(seed=9)
    sampler2 = reference.ResumableBatchSampler(40, 8, seed=77)
    state = reference.TrainState.from_payload(reference.load(path), path=str(path))
    assert (state.global_step, state.epoch, state.batch_in_epoch) == (7, 1, 2)
    assert state.loss_history == history and state.extra == {"note": "mid-epoch"}
    assert state.schema == reference.CURRENT_SCHEMA and state.path == str(path)
    state.restore(model2, optimizer2, scheduler2)
    sampler2.load_state_dict(state.data_order)
    for k, v in saved_model.items():
        assert torch.equal(model2.state_dict()[k], v)
    assert scheduler2.state_dict() == payload["scheduler"]
    assert _train(model2, optimizer2, scheduler2, sampler2, x, y, 9) == expected


def test_from_payload_requires_the_fields(tmp_path):
    payload = reference.capture(torch.nn.Linear(2, 2), global_step=1)
    for missing in ("schema", "model", "counters", "rng"):
        broken = {k: v for k, v in payload.items() if k != missing}
        with pytest.raises(reference.SchemaError, match=missing) as info:
            reference.TrainState.from_payload(broken, path="p.pt")
        assert "p.pt" in str(info.value)
    for counters in ({"global_step": 1, "epoch": 0}, {"global_step": "x", "epoch": 0, "batch_in_epoch": 0}, None):
        with pytest.raises(reference.SchemaError, match="counters"):
            reference.TrainState.from_payload({**payload, "counters": counters}, path="p.pt")


def test_restore_into_an_optimizer_the_checkpoint_lacks(tmp_path):
    model = torch.nn.Linear(2, 2)
    state = reference.TrainState.from_payload(reference.capture(model, global_step=1), path="p.pt")
    with pytest.raises(reference.CheckpointError, match="optimizer") as info:
        state.restore(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "p.pt" in str(info.value)
    state.restore(model, rng=False)
