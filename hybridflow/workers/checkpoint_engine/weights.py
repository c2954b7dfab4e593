"""Both ends of a checkpoint engine's stream: the trainer's named tensors, and the replica loading them.

The trainer's stream walks the actor's FSDP units one at a time (each unit is all-gathered, its
tensors handed out, then resharded before the next: every trainer rank walks the same units in the
same order, as the gathers are collectives). A LoRA actor's adapter is merged into its base weights
under the plain HF names, as the object-store sync always did. No rank holds more than one unit
gathered, so no rank ever holds the whole model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
from torch import nn


def trainer_weight_stream(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` for every weight of the actor ``module`` (FSDP2-sharded or plain),
    in module order. The tensors are valid until the next item is requested (the unit is resharded
    after its last tensor)."""
    from hybridflow.workers.lora import merged_hf_weights
    from hybridflow.workers.rollout.engine.weight_sync import iter_parameter_buckets

    with torch.no_grad():
        for bucket, _ in iter_parameter_buckets(module):
            for name, tensor in merged_hf_weights(module, bucket):
                if hasattr(tensor, "full_tensor"):  # a tensor-parallel DTensor: its full value
                    tensor = tensor.full_tensor()
                yield name, tensor.detach()


def load_received(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Copy each received ``(HF name, tensor)`` into ``module``'s parameter of that name (cast to the
    parameter's dtype). Raises naming the missing, unknown, repeated or mis-shaped names once the
    stream is consumed (the senders finish their transfer first). Returns ``load_s`` and the bytes."""
    start = time.perf_counter()
    params = dict(module.named_parameters())
    seen: set[str] = set()
    unknown, repeated, mismatched = [], [], []
    received = 0
    with torch.no_grad():
        for name, tensor in weights:
            if name not in params:
                unknown.append(name)
            elif name in seen:
                repeated.append(name)
            elif tuple(tensor.shape) != tuple(params[name].shape):
                mismatched.append(f"{name}: model {tuple(params[name].shape)}, got {tuple(tensor.shape)}")
            else:
                params[name].copy_(tensor)
            seen.add(name)
            received += tensor.numel() * tensor.element_size()
    missing = sorted(set(params) - seen)
    problems = [("missing", missing), ("unknown", unknown), ("sent twice", repeated), ("shape", mismatched)]
    found = [f"{what}: {', '.join(names[:10])}" for what, names in problems if names]
    if found:
        raise ValueError("rollout weight sync: " + "; ".join(found))
    return {"load_s": time.perf_counter() - start, "received_bytes": float(received)}
