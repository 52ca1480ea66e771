"""Mid-epoch resume: a batch sampler whose position is (epoch, batches consumed) plus the
generator state captured at the start of the epoch.

Saving the generator at epoch start (not its current state, which has already drawn this epoch's
permutation) is what lets a resumed run redraw exactly the same permutation and skip the consumed
batches by index, without reading the skipped data.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class ResumableBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields lists of indices; pass as `batch_sampler=` to a DataLoader (num_workers=0 counts
    batches exactly; with workers, call `mark_consumed` from the training loop instead)."""

    def __init__(self, num_samples: int, batch_size: int, *, seed: int, shuffle: bool = True,
                 drop_last: bool = False, count_on_yield: bool = True):
        if num_samples < 0 or batch_size < 1:
            raise ValueError(f"need num_samples >= 0 and batch_size >= 1, got {num_samples}, {batch_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.count_on_yield = count_on_yield
        self.generator = torch.Generator().manual_seed(int(seed))
        self.epoch = 0
        self.batches_consumed = 0
        self._epoch_start_state = self.generator.get_state()
        self._order: list[int] | None = None

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def _draw_order(self) -> list[int]:
        self.generator.set_state(self._epoch_start_state)
        if self.shuffle:
            return torch.randperm(self.num_samples, generator=self.generator).tolist()
        return list(range(self.num_samples))

    def __iter__(self) -> Iterator[list[int]]:
        if self.batches_consumed >= len(self):
            self.start_next_epoch()
        order = self._draw_order()
        for b in range(self.batches_consumed, len(self)):
            batch = order[b * self.batch_size:(b + 1) * self.batch_size]
            if self.count_on_yield:
                self.batches_consumed = b + 1
            yield batch
        # The epoch is finished; the next __iter__ moves on. The position stays (epoch, len).

    def mark_consumed(self, n: int = 1) -> None:
        self.batches_consumed += n

    def start_next_epoch(self) -> None:
        """Advance to the next epoch: the generator continues from after this epoch's draw."""
        self._draw_order()
        self.epoch += 1
        self.batches_consumed = 0
        self._epoch_start_state = self.generator.get_state()

    def epoch_finished(self) -> bool:
        return self.batches_consumed >= len(self)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed,
                "generator_at_epoch_start": self._epoch_start_state.clone(),
                "num_samples": self.num_samples, "batch_size": self.batch_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "batch_size", "shuffle", "drop_last"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"data-order state was saved with {key}={state.get(key)!r}, "
                                 f"this sampler has {getattr(self, key)!r}; resuming would change the data order")
        self.epoch = int(state["epoch"])
        self.batches_consumed = int(state["batches_consumed"])
        self._epoch_start_state = state["generator_at_epoch_start"].clone().to(torch.uint8)
