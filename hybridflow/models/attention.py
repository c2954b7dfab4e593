"""Attention for the trained models (actor, reference, critic, reward model) on the CPU.

PyTorch's SDPA kernel for the CPU (flash attention) is slow for the short sequences of RL
post-training on small machines, worst in bf16: measured on the 2-core AVX-512 machine of
docs/benchmarks.md, a forward and backward of a 3M Qwen2 over 64 x 146 tokens takes 1.36 s with SDPA
and 0.95 s with two matmuls and a softmax under bf16 autocast (fp32: 1.64 s vs 1.52 s). The matmul form stores
the (B, heads, T, T) attention weights for the backward, which is what SDPA avoids, so it is used only
while those are small.

:data:`CPU_ATTENTION` is registered with transformers' attention interface: a call is the
matmul form (HF's ``eager`` attention, with the softmax in fp32) on the CPU when the weights take at
most :data:`EAGER_MAX_BYTES`, and transformers' own SDPA otherwise (and on any other device). Masks
are prepared as for SDPA (boolean, or None for plain causal attention); a 4-D boolean mask passed by
the caller (:mod:`hybridflow.workers.shared_prefix`) is used as is. A 4-D mask that carries a
:class:`PackedRows` (``mask.packed_rows``, :mod:`hybridflow.workers.packed_rows`) means the sequence
is packed tokens: the attention is gathered per padded row (:func:`packed_attention`). A mask that also
carries a ``sequence_slice`` holds one rank's slice of a sequence split by Ulysses sequence parallelism:
the heads are exchanged all-to-all around that packed attention (:mod:`hybridflow.utils.ulysses`). The worker
loads models with it on the CPU unless ``model.override_config.attn_implementation`` names another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_ATTENTION = "hybridflow_cpu"
# the fp32 attention weights of one layer call, kept for the backward
EAGER_MAX_BYTES = 32 * 2**20


@dataclass
class PackedRows:
    """Where each padded row's queries and keys are among the ``N`` packed tokens of a padding-free
    forward (``b`` rows, ``Q`` query slots, ``K`` key slots per row)."""

    query_index: torch.Tensor  # (b, Q) packed token of query slot i of row r (0 in unused slots)
    key_index: torch.Tensor  # (b, K) packed token of key slot j of row r (0 in unused slots)
    token_slot: torch.Tensor  # (N,) flat query slot (r * Q + i) that computes each packed token
    # one row queried whole (a single sequence): its mask is plain causal and the carried (1, 1, Q, K)
    # mask is a stride-0 placeholder, never read (an O(T^2) mask is 64 MiB at 8k tokens)
    causal: bool = False


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    packed: PackedRows,
    attend,
) -> torch.Tensor:
    """query (1, nh, N, hd), key and value (1, nkv, N, hd) of the packed tokens, mask (b, 1, Q, K)
    bool → (1, N, nh, hd). ``attend(q, k, v, mask)`` is the attention of the gathered rows:
    (b, nh, Q, hd), (b, nkv, K, hd) twice and the mask → (b, nh, Q, hd). Every packed token is the
    query of exactly one slot, so the output is gathered back without sums."""
    rows, max_queries = packed.query_index.shape
    max_keys = packed.key_index.shape[1]
    num_heads, head_dim = query.shape[1], query.shape[3]

    def per_row(tokens: torch.Tensor, index: torch.Tensor, slots: int) -> torch.Tensor:
        heads = tokens.shape[1]
        picked = tokens[0].transpose(0, 1).index_select(0, index.reshape(-1))  # (b * slots, heads, hd)
        return picked.view(rows, slots, heads, head_dim).transpose(1, 2)

    out = attend(
        per_row(query, packed.query_index, max_queries),
        per_row(key, packed.key_index, max_keys),
        per_row(value, packed.key_index, max_keys),
        mask,
    )
    out = out.transpose(1, 2).reshape(rows * max_queries, num_heads, head_dim)
    return out.index_select(0, packed.token_slot).unsqueeze(0)


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keep: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention as two matmuls, the softmax in fp32 at least (as HF's eager attention).

    query (B, nh, Tq, hd), key and value (B, nkv, Tk, hd), keep (B | 1, 1, Tq, Tk) bool (True:
    attend) or an additive float mask, or None → (B, nh, Tq, hd). Query head ``h`` reads kv head
    ``h // g`` (g = nh / nkv, HF's ``repeat_kv``); the g heads of a group are one (g * Tq)-row
    matmul, so the keys are never repeated. ``softcap`` (Gemma 2/3's attention logit softcapping):
    the scaled scores become ``softcap * tanh(scores / softcap)`` before the mask, as HF's eager
    attention does. A row that attends nothing gets the dtype's minimum, not -inf, and stays finite."""
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = num_heads // num_kv_heads
    rows = query.reshape(batch, num_kv_heads, groups * q_len, head_dim)
    scores = torch.matmul(rows, key.transpose(-1, -2)) * scale  # (B, nkv, g * Tq, Tk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if keep is not None:
        scores = scores.view(batch, num_kv_heads, groups, q_len, kv_len)
        mask = keep.unsqueeze(2)  # (B | 1, 1, 1, Tq, Tk): the same for every head
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
        scores = scores.view(batch, num_kv_heads, groups * q_len, kv_len)
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return torch.matmul(weights.to(value.dtype), value).view(batch, num_heads, q_len, head_dim)


def windowed(keep: torch.Tensor, window: int) -> torch.Tensor:
    """``keep`` (..., Tq, Tk) bool with each query's keys limited to its ``window`` most recent
    positions (HF's sliding window: key position ``k`` is kept for query position ``q`` when
    ``q - k < window``). Positions are counted over the attended keys, so this holds in every layout
    whose attended keys of a query are its own consecutive positions ending at itself: the padded
    layout (left padding False), packed rows (prompt, then the row's response), a shared-prompt block
    mask (other responses' slots False between), and a mask already windowed (unchanged)."""
    after = keep.sum(-1, keepdim=True) - keep.cumsum(-1)  # attended keys after each key, for each query
    return keep & (after < window)


def _keep_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool keep mask from a bool one or an additive float one (0 where attended)."""
    return mask if mask.dtype == torch.bool else mask == 0


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)[None, None]


def cpu_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, nh, Tq, hd), key and value (B, nkv, Tk, hd), attention_mask (B | 1, 1, Tq, Tk) bool
    (True: attend) or additive float, or None (causal) → output (B, Tq, nh, hd), as HF's attention
    functions return it. A layer that passes ``softcap`` (attention logit softcapping) or
    ``sliding_window`` (Gemma 2/3, Mistral) gets both in every layout: the matmul form always (SDPA
    has no softcap), the window applied to whatever mask the layout carries (:func:`windowed`)."""
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    exact = _Exact(kwargs.get("softcap"), kwargs.get("sliding_window"))
    packed = getattr(attention_mask, "packed_rows", None)
    sequence_slice = getattr(attention_mask, "sequence_slice", None)  # Ulysses: this rank's tokens only
    if sequence_slice is not None:
        return _sequence_parallel_forward(
            module, query, key, value, attention_mask, sequence_slice, dropout, scale, exact
        )
    if packed is not None:
        out = _packed_forward(module, query, key, value, attention_mask, packed, dropout, scale, exact)
        return out, None
    batch, num_heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    too_big = batch * num_heads * q_len * kv_len * 4 > EAGER_MAX_BYTES
    if not exact.needed and (query.device.type != "cpu" or too_big or (dropout > 0 and module.training)):
        return _sdpa_forward()(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal and q_len > 1:
        attention_mask = _causal_mask(q_len, kv_len, query.device)
    if dropout > 0 and module.training:  # the exact path has no fused dropout: rare (Gemma's is 0)
        raise ValueError("attention dropout with softcap or a sliding window is not supported here")
    keep = exact.mask(attention_mask, q_len, kv_len, query.device)
    out = grouped_attention(query, key, value, keep, scale, exact.softcap)
    return out.transpose(1, 2).contiguous(), None


@dataclass
class _Exact:
    """What a layer asks beyond plain softmax attention: ``softcap`` and ``window`` (None: not)."""

    softcap: float | None
    window: int | None

    def __post_init__(self) -> None:
        self.softcap = float(self.softcap) if self.softcap else None
        self.window = int(self.window) if self.window else None

    @property
    def needed(self) -> bool:
        return self.softcap is not None or self.window is not None

    def mask(
        self, mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device
    ) -> torch.Tensor | None:
        """``mask`` with the window applied (None stays None when no key can fall outside it)."""
        if self.window is None or kv_len <= self.window:
            return mask
        if mask is None:
            mask = _causal_mask(q_len, kv_len, device)
        return windowed(_keep_mask(mask), self.window)


def _packed_forward(
    module, query, key, value, mask, packed: PackedRows, dropout: float, scale: float, exact: _Exact
):
    """(1, N, nh, hd) attention output of the packed tokens: the matmul form, or SDPA (on other
    devices, for large weights, or with dropout in training; never with a softcap or a window)."""
    rows, max_queries = packed.query_index.shape
    max_keys = packed.key_index.shape[1]
    weight_bytes = rows * query.shape[1] * max_queries * max_keys * 4
    dropout = dropout if module.training else 0.0
    # One row queried whole (a single sequence, as under sequence parallelism with one per micro-batch):
    # its mask is plain causal. SDPA's flash kernel applies that without a mask; given the (Q, K) bool
    # mask it saves a float copy of it per layer for the backward (256 MiB a layer at 8k tokens).
    causal = packed.causal or (rows == 1 and max_queries == max_keys)
    small = query.device.type == "cpu" and weight_bytes <= EAGER_MAX_BYTES and dropout == 0
    if small or exact.needed:
        if packed.causal:  # the carried mask is a placeholder: the causal mask, small on this path
            mask = _causal_mask(max_queries, max_queries, query.device)
        mask = exact.mask(mask, max_queries, max_keys, query.device)
        return packed_attention(
            query,
            key,
            value,
            mask,
            packed,
            lambda q, k, v, m: grouped_attention(q, k, v, m, scale, exact.softcap),
        )

    def sdpa(q, k, v, m):
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if causal else m,
            dropout_p=dropout,
            scale=scale,
            is_causal=causal,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    return packed_attention(query, key, value, mask, packed, sdpa)


def _sequence_parallel_forward(
    module, query, key, value, mask, sequence_slice, dropout: float, scale: float, exact: _Exact
):
    """(1, L, nh, hd) output of this rank's L packed tokens when the sequence is split over a Ulysses
    group (:mod:`hybridflow.utils.ulysses`): all-to-all to whole-sequence heads, the packed attention
    of those heads, all-to-all back."""
    from hybridflow.utils.ulysses import ulysses_attention

    packed = getattr(mask, "packed_rows", None)
    if packed is None:
        raise ValueError("sequence parallelism needs the packed-rows layout (mask.packed_rows)")
    output = ulysses_attention(
        query,
        key,
        value,
        sequence_slice,
        lambda q, k, v: _packed_forward(module, q, k, v, mask, packed, dropout, scale, exact),
    )
    return output, None


def _sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def register_cpu_attention() -> str:
    """Register :data:`CPU_ATTENTION` (and SDPA's mask format for it) with transformers; returns the
    name to pass as ``attn_implementation``. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CPU_ATTENTION, cpu_attention_forward)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    return CPU_ATTENTION
