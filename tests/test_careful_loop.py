"""The careful loop's one subtle piece, and the torchdata behaviour behind it: a
StatefulDataLoader with its own shuffle generator, resumed from state_dict(), shuffles every later
epoch the same as an uninterrupted run only if the generator's state (and the global RNG) are
restored after iter(loader). If torchdata changes this, these tests say so."""
from __future__ import annotations

import warnings

import pytest
import torch

stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="needs the 'torchdata' extra")

DATA = torch.utils.data.TensorDataset(torch.arange(40))


def _train(n: int, *, resume: dict | None = None, stop: int | None = None, restore: str = "after"):
    """Batches (and one global-RNG draw per batch, like dropout) of a run; with `stop`, the state
    after that many batches; with `resume`, a fresh loader continues from such a state."""
    torch.manual_seed(0 if resume is None else 999)
    loader = stateful.StatefulDataLoader(DATA, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    out = list(resume["seen"]) if resume else []
    if resume:
        loader.load_state_dict(resume["loader"])
    pending = resume
    while len(out) < n:
        if pending and restore == "before":
            torch.set_rng_state(pending["rng"])
            loader.generator.set_state(pending["gen"])
            pending = None
        batches = iter(loader)
        if pending and restore in ("after", "rng_only"):
            torch.set_rng_state(pending["rng"])
            if restore == "after":
                loader.generator.set_state(pending["gen"])
            pending = None
        for (b,) in batches:
            out.append((b.tolist(), round(torch.rand(1).item(), 6)))
            if stop is not None and len(out) == stop:
                return {"seen": out, "loader": loader.state_dict(), "rng": torch.get_rng_state(),
                        "gen": loader.generator.get_state()}
            if len(out) >= n:
                break
    return out


def _first_difference(restore: str, k: int) -> int | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = _train(15)
        got = _train(15, resume=_train(15, stop=k), restore=restore)
    return next((i + 1 for i, (a, b) in enumerate(zip(full, got)) if a != b), None)


@pytest.mark.parametrize("k", [3, 5, 9])
def test_restoring_the_rngs_after_iter_resumes_exactly(k):
    assert _first_difference("after", k) is None


@pytest.mark.parametrize("restore", ["before", "rng_only"])
def test_otherwise_the_epochs_after_the_resumed_one_are_shuffled_differently(restore):
    """torchdata 0.11: the state_dict restores the generator to the current epoch's start only."""
    assert _first_difference(restore, 9) == 11   # epoch 2 (batches 6-10) continues; epoch 3 differs
    assert _first_difference(restore, 5) == 6    # even resumed at an epoch boundary
