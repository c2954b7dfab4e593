"""Tensor-parallel generation: the engine's weights split over the ``t_g`` ranks of a generation group.

Megatron's split, on the engine's fused layout: each rank owns ``nh / t_g`` query heads and
``nkv / t_g`` key/value heads (its slice of the fused qkv matrix and of the KV cache), ``I / t_g`` MLP
columns (its slice of gate_up and down) and ``V / t_g`` vocabulary rows of the embedding and the LM head.
A forward needs four collectives per step and layer-independent ones at the ends:

- embedding: each rank looks up the tokens of its vocabulary slice (zeros elsewhere), then all-reduce;
- after o_proj and after down_proj: the partial sums over the local heads / columns are all-reduced;
- logits: the (B, V / t_g) slices are all-gathered into (B, V), so every rank samples the same token
  from the same logits with the same generator state.

Norms and biases of o_proj / down_proj are held whole (the biases are added once, after the reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.workers.tensor_parallel import split_dim


@dataclass(frozen=True)
class GenerationShard:
    """This rank's place in its generation group: it holds shard ``rank`` of ``size``; collectives run
    over ``group``. ``shard_of_member[k]`` is the shard the group's k-th member holds (torch numbers a
    group's members by ascending global rank, which need not be the shard order); None: the identity."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    shard_of_member: tuple[int, ...] | None = None

    @property
    def parallel(self) -> bool:
        return self.size > 1


SINGLE = GenerationShard(rank=0, size=1)


def shard_slice(
    name: str, full_shape: tuple[int, ...], shard: GenerationShard
) -> tuple[int, int, int] | None:
    """``(dim, start, end)`` of HF parameter ``name`` (full shape ``full_shape``) that ``shard`` holds,
    or None when it holds the whole tensor."""
    dim = split_dim(name)
    if dim is None or not shard.parallel:
        return None
    size = full_shape[dim]
    if size % shard.size:
        raise ValueError(f"{name}: dim {dim} of size {size} does not split {shard.size} ways")
    part = size // shard.size
    return dim, shard.rank * part, (shard.rank + 1) * part


def take_shard(name: str, full: torch.Tensor, shard: GenerationShard) -> torch.Tensor:
    """The part of a whole HF parameter that ``shard`` holds (a view)."""
    cut = shard_slice(name, tuple(full.shape), shard)
    if cut is None:
        return full
    dim, start, end = cut
    return full.narrow(dim, start, end - start)


def sum_over_group(x: torch.Tensor, shard: GenerationShard) -> torch.Tensor:
    """All-reduce (sum) of the partial results of the group's ranks, in place; ``x`` itself when alone."""
    if shard.parallel:
        dist.all_reduce(x, group=shard.group)
    return x


def gather_last_dim(x: torch.Tensor, shard: GenerationShard) -> torch.Tensor:
    """Concatenate the group's (..., n) slices along the last dim in rank order: (..., n * size)."""
    if not shard.parallel:
        return x
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    if shard.shard_of_member is not None:
        ordered = [None] * shard.size
        for member, index in enumerate(shard.shard_of_member):
            ordered[index] = parts[member]
        parts = ordered
    return torch.cat(parts, dim=-1)
