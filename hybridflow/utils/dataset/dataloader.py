"""A resumable, single-process data loader.

``StatefulDataLoader`` yields one epoch per ``iter()``; the order of epoch ``e`` is
``torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + e))``, so it depends
only on ``(seed, e)``. ``state_dict()`` records the epoch and how many of its batches were handed
out, so a loader rebuilt from a checkpoint yields exactly the batch that would have come next.
There are no worker processes (the dataset's ``__getitem__`` runs in the caller).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hybridflow.utils.dataset.rl_dataset import collate_fn as default_collate_fn

logger = logging.getLogger(__name__)


class StatefulDataLoader:
    """Batches of ``collate_fn([dataset[i] for i in batch_indices])``, resumable mid-epoch."""

    def __init__(
        self,
        dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 1,
        drop_last: bool = True,
        collate_fn: Callable[[list], Any] = default_collate_fn,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.epoch = 0
        self.batches_yielded = 0  # batches of ``self.epoch`` already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch ``epoch`` visits them."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=generator).tolist()

    def __iter__(self) -> Iterator[Any]:
        """Yield the rest of the current epoch (all of it unless resumed mid-epoch), then advance."""
        if len(self) == 0:
            return
        if self.batches_yielded >= len(self):  # the previous epoch was used up without finishing the loop
            self._next_epoch()
        order = self.epoch_order(self.epoch)
        while self.batches_yielded < len(self):
            start = self.batches_yielded * self.batch_size
            indices = order[start : start + self.batch_size]
            self.batches_yielded += 1  # before yielding: a checkpoint saved mid-step resumes after this batch
            yield self.collate_fn([self.dataset[i] for i in indices])
        self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.batches_yielded = 0

    def iter_forever(self) -> Iterator[Any]:
        """Batches across epochs without end (``for batch in loader.iter_forever(): ...``)."""
        if len(self) == 0:
            raise ValueError("StatefulDataLoader: no full batch in the dataset; cannot iterate forever")
        while True:
            yield from self

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "batches_yielded", "seed"}``: everything needed to continue the stream."""
        return {"epoch": self.epoch, "batches_yielded": self.batches_yielded, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``; the saved seed replaces the constructor's (warning if they differ)."""
        missing = {"epoch", "batches_yielded", "seed"} - set(state)
        if missing:
            raise KeyError(f"StatefulDataLoader.load_state_dict: state lacks {sorted(missing)}")
        if int(state["seed"]) != self.seed:
            logger.warning(
                "StatefulDataLoader: resuming with saved seed %s (was %s)", state["seed"], self.seed
            )
        self.epoch = int(state["epoch"])
        self.batches_yielded = int(state["batches_yielded"])
        self.seed = int(state["seed"])
