"""The hybrid engine's weight hand-off: FSDP2-sharded training parameters → the engine's tensors.

Parameters move one FSDP unit at a time (a decoder layer, then the root's embedding/norm/head): the
unit is unsharded (one all-gather, a collective every rank joins in the same order), each of its
parameters is copied into the engine's own tensor, and the unit is resharded, which frees the
gathered memory before the next unit is gathered. A LoRA actor (peft) hands over its base weights
with the adapter merged in, under the plain HF names. A second full copy of the model never exists;
:class:`SyncStats` reports the time and the peak extra memory, measured from the storage the
gathered tensors actually hold.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hybridflow.workers.lora import merged_hf_weights


@dataclass
class SyncStats:
    seconds: float
    tensors: int
    bytes_copied: int
    peak_extra_bytes: int  # most gathered (unsharded) bytes held at once

    def metrics(self) -> dict[str, float]:
        return {
            "update_weights": self.seconds,
            "perf/update_weights_peak_extra_mb": self.peak_extra_bytes / 2**20,
            "perf/update_weights_mb": self.bytes_copied / 2**20,
        }


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (0 for storages freed by a reshard)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def iter_parameter_buckets(module: nn.Module) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Yield ``(bucket, gathered)``: full parameters as ``[(name, tensor)]`` one FSDP unit at a time
    (``gathered=True``: the tensors are unsharded copies, freed when the next bucket is requested),
    or, for a plain module, one bucket of its own parameters (``gathered=False``: no extra memory)."""
    units = [(prefix, m) for prefix, m in module.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        yield [(name, p.detach()) for name, p in module.named_parameters()], False
        return
    owned: dict[str, list[str]] = {prefix: [] for prefix, _ in units}
    for name, _ in module.named_parameters():
        owner = max((p for p in owned if p == "" or name.startswith(p + ".")), key=len)
        owned[owner].append(name)
    for prefix, unit in units:
        unit.unshard()
        try:
            yield [(name, module.get_parameter(name).detach()) for name in owned[prefix]], True
        finally:
            unit.reshard()


def sync_weights(engine_model, module: nn.Module) -> SyncStats:
    """Copy every (LoRA-merged) parameter of ``module`` into ``engine_model`` (see the module docstring)."""
    start = time.perf_counter()
    earlier: list[torch.Tensor] = []  # gathered tensors of finished buckets: their storage must be freed
    peak = copied = count = 0
    with torch.no_grad():
        for bucket, gathered in iter_parameter_buckets(module):
            tensors = [tensor for _, tensor in bucket]
            if gathered:
                peak = max(peak, storage_bytes(tensors) + storage_bytes(earlier))
            for name, tensor in merged_hf_weights(module, bucket):
                engine_model.load_weight(name, tensor)
                copied += tensor.numel() * tensor.element_size()
                count += 1
            if gathered:
                earlier.extend(tensors)
    return SyncStats(time.perf_counter() - start, count, copied, peak)
