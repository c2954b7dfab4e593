"""The hybrid engine's weight hand-off: FSDP2-sharded training parameters → the engine's tensors.

Parameters move one FSDP unit at a time (a decoder layer, then the root's embedding/norm/head): the
unit is unsharded (one all-gather, a collective every rank joins in the same order), each of its
parameters is copied into the engine's own tensor, and the unit is resharded, which frees the
gathered memory before the next unit is gathered. A LoRA actor (peft) hands over its base weights
with the adapter merged in, under the plain HF names. A second full copy of the model never exists;
:class:`SyncStats` reports the time and the peak extra memory, measured from the storage the
gathered tensors actually hold.

Every sync is checked (:class:`WeightLedger`): each engine weight must arrive exactly once with its
expected shape. A missing, unknown, repeated or mis-shaped tensor raises :class:`WeightSyncError`
naming all of them, after the last unit (so every rank finishes the same collectives first), rather
than leaving the engine to generate from uninitialised or stale memory.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hybridflow.workers.lora import merged_hf_weights
from hybridflow.workers.rollout.engine.parallel import SINGLE, take_shard


@dataclass
class SyncStats:
    seconds: float
    tensors: int
    bytes_copied: int  # bytes written into the engine's tensors
    peak_extra_bytes: int  # most gathered (unsharded) or in-flight buffer bytes held at once
    sent_bytes: int = 0  # bytes this rank sent to / received from other ranks (resharding: the exchange;
    received_bytes: int = 0  # the all-gather sync: the gathered bytes it did not hold)

    def metrics(self) -> dict[str, float]:
        return {
            "update_weights": self.seconds,
            "perf/update_weights_peak_extra_mb": self.peak_extra_bytes / 2**20,
            "perf/update_weights_mb": self.bytes_copied / 2**20,
            "perf/update_weights_received_mb": self.received_bytes / 2**20,
        }


class WeightSyncError(RuntimeError):
    """A weight sync did not deliver exactly the engine's tensors (the message names each one)."""


@dataclass
class WeightLedger:
    """What one full sync into ``engine_model`` delivered, against what it expects
    (:meth:`EngineModel.weight_shapes`)."""

    engine_model: object
    expected: dict[str, tuple[int, ...]] = field(init=False)
    received: Counter = field(init=False, default_factory=Counter)
    unknown: list[str] = field(init=False, default_factory=list)
    mismatched: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.expected = self.engine_model.weight_shapes()

    def accept(self, name: str, tensor: torch.Tensor) -> bool:
        """Record ``name``; True when it should be copied into the engine (known, right shape)."""
        return self.accept_shape(name, tuple(tensor.shape))

    def accept_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        """:meth:`accept` for a tensor of ``shape`` that is still to be assembled (resharding)."""
        if name in self.engine_model.ignored_weight_names:
            return False
        if name not in self.expected:
            self.unknown.append(f"{name} {shape}")
            return False
        self.received[name] += 1
        if shape != self.expected[name]:
            self.mismatched.append(f"{name}: engine expects {self.expected[name]}, got {shape}")
            return False
        return True

    def problems(self) -> list[str]:
        missing = [name for name in self.expected if self.received[name] == 0]
        repeated = [f"{name} (x{count})" for name, count in self.received.items() if count > 1]
        found = [("missing", missing), ("unknown to the engine", self.unknown)]
        found += [("shape mismatch", self.mismatched), ("sent more than once", repeated)]
        return [f"{what}: {_listed(names)}" for what, names in found if names]

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise WeightSyncError(
                "rollout weight sync: the actor's parameters do not match the engine's weights; "
                + "; ".join(problems)
            )


def _listed(names: list[str], limit: int = 20) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (0 for storages freed by a reshard)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _fsdp_units(module: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """``[(FSDP unit, names of the parameters it owns)]`` in module order (empty for a plain module)."""
    units = [(prefix, m) for prefix, m in module.named_modules() if isinstance(m, FSDPModule)]
    owned: dict[str, list[str]] = {prefix: [] for prefix, _ in units}
    for name, _ in module.named_parameters():
        if owned:
            owner = max((p for p in owned if p == "" or name.startswith(p + ".")), key=len)
            owned[owner].append(name)
    return [(unit, owned[prefix]) for prefix, unit in units]


def iter_unit_parameters(module: nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``[(name, parameter)]`` one FSDP unit at a time, as they are (sharded; nothing is gathered); a
    plain module is one unit. Every rank walks the same units in the same order."""
    units = _fsdp_units(module)
    if not units:
        yield list(module.named_parameters())
        return
    for _, names in units:
        yield [(name, module.get_parameter(name)) for name in names]


def iter_parameter_buckets(module: nn.Module) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Yield ``(bucket, gathered)``: full parameters as ``[(name, tensor)]`` one FSDP unit at a time
    (``gathered=True``: the tensors are unsharded copies, freed when the next bucket is requested),
    or, for a plain module, one bucket of its own parameters (``gathered=False``: no extra memory)."""
    units = _fsdp_units(module)
    if not units:
        yield [(name, p.detach()) for name, p in module.named_parameters()], False
        return
    for unit, names in units:
        unit.unshard()
        try:
            yield [(name, module.get_parameter(name).detach()) for name in names], True
        finally:
            unit.reshard()


def sync_weights(engine_model, module: nn.Module) -> SyncStats:
    """Copy every (LoRA-merged) parameter of ``module`` into ``engine_model`` (see the module
    docstring); raises :class:`WeightSyncError` unless each engine weight arrived once, well shaped.
    A tensor-parallel engine (``engine_model.shard``) keeps its share of each gathered parameter; only
    a LoRA actor takes this path then (:mod:`.reshard` moves only the shares otherwise)."""
    start = time.perf_counter()
    earlier: list[torch.Tensor] = []  # gathered tensors of finished buckets: their storage must be freed
    peak = copied = count = received = 0
    ledger = WeightLedger(engine_model)
    shard = getattr(engine_model, "shard", SINGLE)
    held = {name: _local_numel(p) for name, p in module.named_parameters()}  # before any unit is gathered
    with torch.no_grad():
        for bucket, gathered in iter_parameter_buckets(module):
            tensors = [tensor for _, tensor in bucket]
            if gathered:
                peak = max(peak, storage_bytes(tensors) + storage_bytes(earlier))
                received += sum((t.numel() - held[n]) * t.element_size() for n, t in bucket)
            for name, full in merged_hf_weights(module, bucket):
                tensor = take_shard(name, full, shard)
                if not ledger.accept(name, tensor):
                    continue
                engine_model.load_weight(name, tensor)
                copied += tensor.numel() * tensor.element_size()
                count += 1
            if gathered:
                earlier.extend(tensors)
    ledger.check()
    return SyncStats(time.perf_counter() - start, count, copied, peak, received_bytes=received)


def _local_numel(param: torch.Tensor) -> int:
    """Elements of a parameter this rank holds (its shard of a DTensor)."""
    return param.to_local().numel() if hasattr(param, "to_local") else param.numel()
