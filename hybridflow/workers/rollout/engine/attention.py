"""Decode attention: one new query per row against that row's cached keys, reading what is valid.

Row b of a decode step attends to positions ``0..lengths[b]`` of its cache slot (its new key is
written at ``lengths[b]`` first). Two ways to read the cache, chosen by :func:`pick_backend`:

- ``"span"``: the first ``span`` positions of every row, the invalid tail of each row masked out.
  ``span`` is ``max(lengths) + 1`` in an eager step (the host knows it, no read back), so a row reads
  ``max(lengths) - lengths[b]`` positions it does not need. On the CPU this profiles best (measured
  on the AVX2 2-core machine, B = 64, 9/3 heads of 64, lengths 32..160, one thread, loaded machine:
  the grouped matmuls 5.7 ms, SDPA 6.6 ms, FlexAttention compiled by inductor 8.5 ms after a 60 s
  compile), and the packed CPU batch keeps ``span`` close to the rows' lengths.
- ``"flex"``: FlexAttention with a block mask built on the device from ``lengths`` (row b's
  ``lengths[b] // block + 1`` key blocks), so the kernel skips every block past a row's length and
  reads only its valid keys, at a shape that never changes (the whole cache). This is the CUDA
  graph's attention: one captured graph per batch bucket, whatever the lengths. It needs
  ``torch.compile`` (eager FlexAttention is a reference implementation that reads everything).

Both are exact softmax attention with HF's ``repeat_kv`` head grouping (query head ``h`` reads kv
head ``h // (nh / nkv)``) and agree to float rounding (tests/workers/rollout/test_static_decode.py).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

FLEX_BLOCK = 128  # key positions per FlexAttention block (its kernels' default)


def pick_backend(device: torch.device, captured: bool) -> str:
    """``HYBRIDFLOW_DECODE_ATTENTION`` (span | flex) if set, else ``flex`` for a captured CUDA step
    (where FlexAttention exists) and ``span`` everywhere else."""
    chosen = os.environ.get("HYBRIDFLOW_DECODE_ATTENTION")
    if chosen:
        if chosen not in ("span", "flex"):
            raise ValueError(f"HYBRIDFLOW_DECODE_ATTENTION={chosen!r}: use span or flex")
        return chosen
    if captured and device.type == "cuda" and _flex_available():
        return "flex"
    return "span"


def span_mask(lengths: torch.Tensor, span: int) -> torch.Tensor:
    """(B, 1, 1, span) bool, True at the positions row b must not read (past ``lengths[b]``): the
    same for every layer of a decode step, so it is made once per step."""
    return (torch.arange(span, device=lengths.device) > lengths.unsqueeze(1))[:, None, None, :]


def span_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, nh, 1, hd), k and v (B, nkv, S, hd) (the first S cached positions), lengths (B,) →
    (B, nh, 1, hd), row b attending to positions ``0..lengths[b]``; ``hidden``: :func:`span_mask` of
    ``lengths`` and S when the caller made it already. SDPA on CUDA; on the CPU the grouped matmuls of
    :func:`~hybridflow.models.attention.grouped_attention` with one query, op for op (SDPA's flash
    kernel is slow for one query: B = 32, 4/2 heads of 64, S = 146, one thread: fp32 460 us against
    376 us, bf16 2257 us against 547 us)."""
    if hidden is None:
        hidden = span_mask(lengths, k.shape[2])
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden, enable_gqa=True)
    batch, num_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rows = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # a group's heads: one matmul
    scores = torch.matmul(rows, k.transpose(-1, -2)) * head_dim**-0.5  # (B, nkv, g, S)
    scores.masked_fill_(hidden, torch.finfo(scores.dtype).min)
    if scores.dtype == torch.float32:
        weights = torch.softmax(scores, dim=-1)
    else:  # the softmax in fp32 at least, as grouped_attention
        weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        weights = weights.to(v.dtype)
    return torch.matmul(weights, v).view(batch, num_heads, 1, head_dim)


def flex_attention_valid(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """As :func:`span_attention` over the whole cache k, v (B, nkv, L, hd), reading only each row's
    valid key blocks: the block mask is made on the device from ``lengths`` (no host read, fixed
    shapes: capturable in a CUDA graph)."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, cache_len = k.shape[0], k.shape[2]
    blocks = -(-cache_len // FLEX_BLOCK)
    kv_num_blocks = (lengths // FLEX_BLOCK + 1).to(torch.int32).view(batch, 1, 1)
    kv_indices = torch.arange(blocks, dtype=torch.int32, device=k.device).expand(batch, 1, 1, blocks)

    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks.contiguous(),
        kv_indices.contiguous(),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=_valid_keys(lengths if lengths._base is None else lengths._base),
        seq_lengths=(q.shape[2], cache_len),
    )
    return _flex(q.device)(q, k, v, block_mask=block_mask, enable_gqa=True)


_MASKS: dict[int, tuple[torch.Tensor, object]] = {}


def _valid_keys(lengths: torch.Tensor):
    """The mask ``kv_idx <= lengths[b]`` as one function per lengths tensor (the decode step's fixed
    buffer; a view of its first rows indexes the same), so the compiled kernel's guards see the same
    function at every step and bucket instead of a new closure that would recompile it."""
    held = _MASKS.get(id(lengths))
    if held is not None and held[0] is lengths:
        return held[1]

    def valid(b, h, q_idx, kv_idx):
        return kv_idx <= lengths[b]

    if len(_MASKS) > 64:  # buffers of released engines
        _MASKS.clear()
    _MASKS[id(lengths)] = (lengths, valid)
    return valid


@functools.cache
def _flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


def _flex(device: torch.device):
    """FlexAttention, compiled on CUDA (batch dimension dynamic after the first recompile, so the
    buckets share one kernel); eager (the reference kernel) on the CPU, where only tests use it."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda" or os.environ.get("HYBRIDFLOW_FLEX_EAGER") == "1":
        return flex_attention
    return _compiled_flex()


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)
