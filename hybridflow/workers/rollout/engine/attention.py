"""Attention over the paged KV cache: one decode query per row, or a prefill's new tokens after a prefix.

The cache is a pool of blocks per layer, keys and values each (nkv, num_blocks, block_size, hd)
(:mod:`.kv_cache`); row b's positions live in the blocks of its table ``table[b]`` (B, W), in order.

Decode (:func:`decode_attention`): row b attends to its positions ``0..lengths[b]`` (its new key is
written at ``lengths[b]`` first). Two ways to read the pool, the same math:

- ``"kernel"`` (the CPU default): :mod:`.paged_kernel` walks each row's table in place and reads only
  its valid keys, at the speed of the former contiguous slots;
- ``"gather"`` (CUDA, or a CPU without a C compiler, or ``HYBRIDFLOW_DECODE_ATTENTION=gather``): the
  first ``span`` positions of every row's table gathered into a contiguous (nkv, B, span, hd) tensor,
  the invalid tail masked. Fixed shapes for a fixed ``span``: capturable in a CUDA graph.

Both are exact softmax attention with HF's ``repeat_kv`` head grouping (query head ``h`` reads kv head
``h // (nh / nkv)``) and agree to float rounding (tests/workers/rollout/test_paged_cache.py).

A layer's :class:`LayerAttention` adds what some families need: the scores' ``scale`` (Gemma's
``query_pre_attn_scalar ** -0.5``; default ``hd ** -0.5``), a logit ``softcap`` (``cap * tanh(s / cap)``
before the softmax, Gemma 2) and a sliding ``window`` W: the query at position i reads keys
``max(0, i - W + 1) .. i`` only. The pool keeps every position; the window is a mask over the blocks
(the kernel starts each row at its first key in the window, the gathered paths hide the older ones).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.workers.rollout.engine.paged_kernel import kernel_handles, paged_decode


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention options (module docstring): None each for plain causal attention."""

    scale: float | None = None
    softcap: float | None = None
    window: int | None = None

    @property
    def plain(self) -> bool:
        return self.scale is None and self.softcap is None and self.window is None


PLAIN = LayerAttention()


def pick_backend(device: torch.device, dtype: torch.dtype) -> str:
    """``HYBRIDFLOW_DECODE_ATTENTION`` (kernel | gather) if set, else ``kernel`` on a CPU where it
    builds and reads ``dtype``, ``gather`` everywhere else."""
    chosen = os.environ.get("HYBRIDFLOW_DECODE_ATTENTION")
    if chosen:
        if chosen not in ("kernel", "gather"):
            raise ValueError(f"HYBRIDFLOW_DECODE_ATTENTION={chosen!r}: use kernel or gather")
        if chosen == "kernel" and not (device.type == "cpu" and kernel_handles(dtype)):
            raise ValueError(f"HYBRIDFLOW_DECODE_ATTENTION=kernel: no paged kernel for {device.type} {dtype}")
        return chosen
    return "kernel" if device.type == "cpu" and kernel_handles(dtype) else "gather"


def gather_span(pool: torch.Tensor, table: torch.Tensor, span: int) -> torch.Tensor:
    """The first ``span`` positions (rounded up to whole blocks) of each row's table: pool (nkv,
    num_blocks, block_size, hd), table (B, W) → (nkv, B, span', hd), contiguous."""
    num_kv_heads, _, block_size, head_dim = pool.shape
    blocks = -(-int(span) // block_size)
    picked = pool[:, table[:, :blocks]]  # (nkv, B, blocks, block_size, hd)
    return picked.view(num_kv_heads, table.shape[0], blocks * block_size, head_dim)


def grouped_scores_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    hidden: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (B, nh, T, hd); keys, values (nkv, B, S, hd); hidden (B, 1 | T, S) bool, True where a query
    must not read → (B, nh, T, hd). One matmul per kv head group (batch dims (nkv, B) contiguous, so no
    copy), the softmax in fp32 at least. ``scale``: the scores' (default hd ** -0.5); ``softcap``:
    scores ``cap * tanh(scores / cap)`` before the mask, as HF's eager attention."""
    batch, num_heads, width, head_dim = q.shape
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    rows = q.reshape(batch, num_kv_heads, group * width, head_dim).transpose(0, 1)  # (nkv, B, g*T, hd)
    scale = head_dim**-0.5 if scale is None else scale
    scores = torch.matmul(rows, keys.transpose(-1, -2)) * scale  # (nkv, B, g*T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(num_kv_heads, batch, group, width, -1)
    scores = scores.masked_fill(hidden[None, :, None], torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = weights.to(values.dtype).view(num_kv_heads, batch, group * width, -1)
    out = torch.matmul(weights, values)  # (nkv, B, g*T, hd)
    return out.transpose(0, 1).reshape(batch, num_heads, width, head_dim)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    backend: str,
    span: int | None = None,
    hidden=None,
    options: LayerAttention = PLAIN,
) -> torch.Tensor:
    """q (B, nh, 1, hd) against one layer's pool ``keys``/``values`` (nkv, num_blocks, block_size, hd)
    through ``table`` (B, W); lengths (B,) → (B, nh, 1, hd). ``span`` (gather): positions read, at
    least ``max(lengths) + 1``; ``hidden``: :func:`decode_masks` for this layer's window, made once per
    step (gather: the (B, 1, span) mask; kernel: the keys each row reads, ``lengths + 1``, contiguous,
    or with a window that and each row's first key). ``options``: the layer's scale, softcap, window."""
    if backend == "kernel":
        if hidden is None:
            hidden = decode_masks(lengths, "kernel", None, options.window)
        counts, starts = hidden if isinstance(hidden, tuple) else (hidden, None)
        scale, softcap = options.scale, options.softcap
        return paged_decode(q, keys, values, table, lengths, counts, starts, scale, softcap)
    if span is None:
        span = int(lengths.max()) + 1
    k, v = gather_span(keys, table, span), gather_span(values, table, span)
    if hidden is None:
        hidden = decode_masks(lengths, "gather", k.shape[2], options.window)
    return grouped_scores_attention(q, k, v, hidden, options.scale, options.softcap)


def decode_masks(lengths: torch.Tensor, backend: str, span: int | None, window: int | None = None):
    """What a decode step's attention needs per row, made once for every layer of one ``window``:
    gather: the (B, 1, span) mask (:func:`span_hidden`, older keys than the window hidden too); kernel:
    the keys each row reads (``lengths + 1``, (B,) contiguous), with a window as a pair with each row's
    first key ``max(0, lengths + 1 - window)`` (B,). Static shapes, no host read (a CUDA graph holds it)."""
    if backend == "kernel":
        counts = (lengths + 1).contiguous()
        if window is None:
            return counts
        return counts, (counts - window).clamp(min=0).contiguous()
    hidden = span_hidden(lengths, span)
    if window is not None:
        old = torch.arange(span, device=lengths.device) <= (lengths - window).unsqueeze(1)  # (B, span)
        hidden = hidden | old.unsqueeze(1)
    return hidden


def span_hidden(lengths: torch.Tensor, span: int) -> torch.Tensor:
    """(B, 1, span) bool, True past each row's ``lengths[b]`` (the positions a decode query skips)."""
    return (torch.arange(span, device=lengths.device) > lengths.unsqueeze(1)).unsqueeze(1)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: LayerAttention = PLAIN, offset=0
) -> torch.Tensor:
    """Causal attention of new tokens among themselves: q (P, nh, T, hd), k and v (P, nkv, T, hd) →
    (P, nh, T, hd). Plain: SDPA's causal kernel; with a scale, softcap or window: the scores with the
    mask built here (query i reads keys ``max(0, i - W + 1) .. i``)."""
    if options.plain:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    width = q.shape[2]
    at = torch.arange(width, device=q.device)
    hidden = at[None, :] > at[:, None]  # (T, T): the future
    if options.window is not None:
        hidden = hidden | (at[None, :] <= at[:, None] - options.window)
    hidden = hidden.expand(q.shape[0], -1, -1)
    return grouped_scores_attention(
        q, k.transpose(0, 1), v.transpose(0, 1), hidden, options.scale, options.softcap
    )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    starts: torch.Tensor,
    prefix_span: int,
    options: LayerAttention = PLAIN,
) -> torch.Tensor:
    """New tokens q (P, nh, T, hd), k and v (P, nkv, T, hd) at positions ``starts[p] + i``, after each
    row's cached prefix of ``starts[p]`` positions in the pool (read through ``table`` (P, W); the
    widest is ``prefix_span``) → (P, nh, T, hd). No prefix (``prefix_span`` 0): causal attention over
    the new tokens alone (:func:`causal_attention`); with one: SDPA's fused kernel under the mask, or
    with a softcap the scores (:func:`grouped_scores_attention`). Right padding never reaches a real
    query under the causal mask. ``options``: the layer's scale, softcap and window (the window counts
    positions: a query at ``starts[p] + i`` reads the prefix from ``starts[p] + i - W + 1`` on)."""
    if prefix_span == 0:
        return causal_attention(q, k, v, options)
    width = q.shape[2]
    old_k = gather_span(keys, table, prefix_span)  # (nkv, P, S0, hd)
    old_v = gather_span(values, table, prefix_span)
    all_k = torch.cat((old_k, k.transpose(0, 1)), dim=2)  # (nkv, P, S0 + T, hd)
    all_v = torch.cat((old_v, v.transpose(0, 1)), dim=2)
    device = q.device
    prefix = torch.arange(old_k.shape[2], device=device)[None, None, :] >= starts[:, None, None]  # (P, 1, S0)
    new = torch.ones(width, width, dtype=torch.bool, device=device).triu(1)  # (T, T): the future
    hidden = torch.cat((prefix.expand(-1, width, -1), new.expand(q.shape[0], -1, -1)), dim=2)
    if options.window is not None:  # keys older than each query's window, by position
        offsets = torch.arange(width, device=device)
        queries = starts[:, None] + offsets[None, :]  # (P, T)
        old = torch.arange(old_k.shape[2], device=device).expand(q.shape[0], -1)  # (P, S0)
        positions = torch.cat((old, queries), dim=1)  # (P, S0 + T)
        hidden = hidden | (positions[:, None, :] <= queries[:, :, None] - options.window)
    if options.softcap is None:  # SDPA's fused kernel with the mask: 37 -> 13.5 ms for 8 rows x 96 new
        # tokens after 384 cached, 9/3 heads of 64, one thread (2-core AMD EPYC AVX-512), within 4e-7
        return F.scaled_dot_product_attention(
            q,
            all_k.transpose(0, 1),
            all_v.transpose(0, 1),
            attn_mask=~hidden[:, None],
            scale=options.scale,
            enable_gqa=True,
        )
    return grouped_scores_attention(q, all_k, all_v, hidden, options.scale, options.softcap)
