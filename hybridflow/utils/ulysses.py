"""Ulysses sequence parallelism's communication (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509).

A sequence of ``S`` tokens is cut into ``sp`` consecutive slices of ``L = S / sp`` tokens, one per rank of
a sequence-parallel group. Everything outside attention is per token, so each rank runs it on its own
slice. Attention needs every token: an all-to-all turns the slice's ``nh`` heads of ``L`` tokens into
``nh / sp`` heads of all ``S`` tokens (:func:`sequence_to_heads`), the rank attends over the whole
sequence for its heads, and a second all-to-all turns the output back (:func:`heads_to_sequence`).
Per layer each rank sends and receives ``3 (q, k, v) + 1 (output)`` tensors of ``L x nh x hd``
elements, ``(sp - 1) / sp`` of them to other ranks: the paper's ``4 N h / sp`` per link.

Gradients: the loss above the model is computed on the gathered (whole-sequence) outputs, identically on
every rank of the group, and FSDP then averages gradients over all ``dp x sp`` ranks. The gather's
backward hands each rank the gradient of its own slice multiplied by ``sp`` (verl's ``grad_scaler``), so
the average over the ``sp`` ranks of a group is the group's whole gradient: the update is the ``dp``-rank
update of SP = 1 (``tests/workers/test_ulysses_exact.py`` checks parameters to 1e-6).

Grouped key/value heads (verl's rule, ``monkey_patch.py``): ``nkv % sp == 0`` splits them like the
query heads; ``sp % nkv == 0`` repeats each ``sp / nkv`` times first (every rank gets one); anything
else cannot be split and is refused
(:func:`hybridflow.utils.ulysses_rules.head_split_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.utils.ulysses_rules import head_split_problem  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class SequenceSlice:
    """Where this rank's slice lies in a sequence-parallel forward (carried by the attention mask).

    ``num_tokens`` real tokens (N) are padded to ``padded = sp * local`` (S); this rank holds tokens
    ``[rank * local, (rank + 1) * local)``."""

    group: dist.ProcessGroup
    rank: int
    size: int
    num_tokens: int
    padded: int

    @property
    def local(self) -> int:
        return self.padded // self.size

    @property
    def start(self) -> int:
        return self.rank * self.local


def padded_length(num_tokens: int, sp: int) -> int:
    """The smallest multiple of ``sp`` holding ``num_tokens`` (at least ``sp``: every rank gets a token)."""
    return max(1, -(-num_tokens // sp)) * sp


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    chunks = [c.contiguous() for c in x.chunk(size, dim=scatter_dim)]
    received = [torch.empty_like(chunks[0]) for _ in range(size)]
    dist.all_to_all(received, chunks, group=group)
    return torch.cat(received, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Scatter ``scatter_dim`` over the group, gather ``gather_dim`` (rank order); the backward is the
    inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, h, L, d) this rank's tokens, all heads → (B, h / sp, sp * L, d) all tokens, this rank's heads."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, S, h / sp, d) all tokens, this rank's heads → (B, S / sp, h, d) this rank's tokens, all heads."""
    return _AllToAll.apply(x, group, 1, 2)


def repeat_kv_heads(x: torch.Tensor, sp: int) -> torch.Tensor:
    """(B, nkv, T, d) → (B, max(nkv, sp), T, d): each kv head repeated ``sp / nkv`` times when there are
    fewer kv heads than ranks (HF's ``repeat_kv`` order, so query head h still reads kv head h // g)."""
    num_kv = x.shape[1]
    return x if num_kv % sp == 0 else x.repeat_interleave(sp // num_kv, dim=1)


class _Gather(torch.autograd.Function):
    """All-gather along ``dim`` in rank order; the backward keeps this rank's part times ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int, scale: float) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.scale, ctx.part = group, dim, scale, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank = dist.get_rank(ctx.group)
        mine = grad.narrow(ctx.dim, rank * ctx.part, ctx.part) * ctx.scale
        return mine.contiguous(), None, None, None


class _Sum(torch.autograd.Function):
    """All-reduce (sum); the backward passes the gradient on times ``scale`` (each rank's summand
    reaches the loss only through the sum, which every rank computes the same)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scale: float) -> torch.Tensor:
        ctx.scale = scale
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None, None


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """(…, L, …) per rank → (…, sp * L, …): the whole sequence on every rank of the group. The backward
    scales by sp (see the module docstring)."""
    return _Gather.apply(x, group, dim, float(dist.get_world_size(group)))


def sum_over_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks, on every rank; the backward scales by sp."""
    return _Sum.apply(x, group, float(dist.get_world_size(group)))


def ulysses_attention(query, key, value, sp: SequenceSlice, attend) -> torch.Tensor:
    """Attention of a sequence split over ``sp.group``.

    query (1, nh, L, hd), key and value (1, nkv, L, hd) of this rank's tokens → (1, L, nh, hd).
    ``attend(q, k, v)`` gets (1, nh / sp, N, hd) and (1, max(nkv, sp) / sp, N, hd) twice, the N real
    tokens of the whole sequence for this rank's heads, and returns (1, N, nh / sp, hd)."""
    group, real = sp.group, sp.num_tokens
    q = sequence_to_heads(query, group)[:, :, :real]
    k = sequence_to_heads(repeat_kv_heads(key, sp.size), group)[:, :, :real]
    v = sequence_to_heads(repeat_kv_heads(value, sp.size), group)[:, :, :real]
    out = attend(q, k, v)  # (1, N, nh / sp, hd)
    out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, sp.padded - real))
    return heads_to_sequence(out, group)
