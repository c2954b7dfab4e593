"""The hybrid engine's weight hand-off: FSDP2-sharded training parameters → the engine's tensors.

Parameters are gathered one at a time (``DTensor.full_tensor()``, a collective every rank joins in the
same order), copied into the engine's own tensor, and dropped before the next is gathered, so at no
point does a second full copy of the model exist. :class:`SyncStats` reports the time and the peak
extra memory the gathered tensors took (measured by tracking which of them are still alive).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SyncStats:
    seconds: float
    tensors: int
    bytes_copied: int
    peak_extra_bytes: int  # most gathered (full) parameter bytes alive at once

    def metrics(self) -> dict[str, float]:
        return {
            "update_weights": self.seconds,
            "perf/update_weights_peak_extra_mb": self.peak_extra_bytes / 2**20,
            "perf/update_weights_mb": self.bytes_copied / 2**20,
        }


def iter_full_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter, gathering sharded ones on demand (collective)."""
    for name, param in module.named_parameters():
        data = param.detach()
        if hasattr(data, "full_tensor"):  # DTensor from fully_shard
            data = data.full_tensor()
        yield name, data


def sync_weights(engine_model, module: nn.Module) -> SyncStats:
    """Copy every parameter of ``module`` into ``engine_model`` (see the module docstring)."""
    start = time.perf_counter()
    alive: list[tuple[weakref.ref, int]] = []
    peak = copied = count = 0
    with torch.no_grad():
        for name, full in iter_full_parameters(module):
            nbytes = full.numel() * full.element_size()
            alive = [(ref, size) for ref, size in alive if ref() is not None]
            alive.append((weakref.ref(full), nbytes))
            peak = max(peak, sum(size for _, size in alive))
            engine_model.load_weight(name, full)
            copied += nbytes
            count += 1
            del full
    return SyncStats(time.perf_counter() - start, count, copied, peak)
