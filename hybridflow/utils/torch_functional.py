"""Small masked-tensor and logits utilities used by the algorithms and the workers (torch only).

Masks are 0/1 tensors broadcastable to the values (float weights also work). Values at masked-out
positions never reach a result, not even as NaN or inf (as verl: values [1, 2, nan, 4] under mask
[1, 0, 0, 1] have mean 2.5), so garbage in padding cannot poison a loss or its gradient. Masked
reductions over an empty selection (mask sum 0) return 0, never NaN: a fully-masked micro-batch then
contributes nothing. verl divides by ``mask.sum() + 1e-8`` instead, which also gives ~0 there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

# Rows of (B, T, V) logits processed at once by logprobs_from_logits; bounds the (rows, T, V) temporary.
_LOGPROB_ROW_CHUNK = 8
# Token positions of (N, V) logits per chunk in entropy_from_logits: bounds the softmax temporary to
# 1024 x V floats (0.6 GB for a 150k vocabulary) instead of N x V.
ENTROPY_CHUNK_TOKENS = 1024


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """``sum(values * mask)`` over ``axis`` (all elements if None). Masked-out values are replaced by 0
    before the product, so a NaN or inf there neither leaks into the sum nor into its gradient."""
    mask = mask.to(values.dtype) if mask.dtype == torch.bool else mask
    kept = torch.where(mask != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if axis is None:
        return (kept * mask).sum()
    return (kept * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set, over ``axis`` (all elements if None).

    Returns 0 (with a finite gradient) wherever the mask sums to 0.
    """
    total = masked_sum(values, mask, axis)
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    count = count.to(total.dtype)
    # Dividing by 1 where count == 0 keeps both the value (total is 0 there) and its gradient finite.
    return total / torch.where(count == 0, torch.ones_like(count), count)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements (a scalar).

    ``unbiased`` applies Bessel's correction ``n / (n - 1)``. With ``n <= 1`` selected elements the
    variance is defined as 0 (verl raises instead), so whitening a tiny or empty batch stays finite.
    """
    mean = masked_mean(values, mask)
    sq_dev = masked_sum((values - mean) ** 2, mask)
    count = mask.sum().to(sq_dev.dtype)
    denom = count - 1 if unbiased else count
    return sq_dev / torch.clamp(denom, min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with masked statistics; keeps the mean if not shift_mean.

    Shapes: values, mask (B, T) -> (B, T). Unmasked positions are transformed too (callers re-mask).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Element-wise ``min(max(x, tensor_min), tensor_max)`` with tensor bounds (as in the PPO value clip)."""
    return torch.max(torch.min(x, tensor_max), tensor_min)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[labels]`` without materialising the full log-softmax.

    Shapes: logits (B, T, V) (any leading dims), labels (B, T) int64 -> (B, T) in logits' dtype.
    fp32/fp64 use ``logit[label] - logsumexp(logits)``; half precision falls back to a chunked
    ``log_softmax`` + gather, because logsumexp in bf16 loses too much precision.
    """
    lead_shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    chunk = _LOGPROB_ROW_CHUNK * max(1, lead_shape[-1] if len(lead_shape) else 1)
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk):
        rows, row_labels = flat_logits[start : start + chunk], flat_labels[start : start + chunk]
        if rows.dtype in (torch.float32, torch.float64):
            picked = rows.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1)
            pieces.append(picked - torch.logsumexp(rows, dim=-1))
        else:
            logp = F.log_softmax(rows.float(), dim=-1)
            pieces.append(logp.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1).to(rows.dtype))
    if not pieces:
        return flat_logits.new_zeros(lead_shape)
    return torch.cat(pieces).reshape(lead_shape)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, chunk_tokens: int = ENTROPY_CHUNK_TOKENS) -> torch.Tensor:
    """Categorical entropy ``H = logsumexp(z) - sum softmax(z) * z``; shape (..., V) -> (...).

    Computed ``chunk_tokens`` positions at a time, so the softmax temporary is (chunk, V), not the
    whole (B, T, V) again. With autograd on, each chunk is recomputed in the backward pass
    (activation checkpointing) instead of keeping its (chunk, V) probabilities alive until then.
    """
    lead_shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] <= chunk_tokens:
        return _entropy(flat).reshape(lead_shape)
    track_grad = torch.is_grad_enabled() and flat.requires_grad
    pieces = []
    for start in range(0, flat.shape[0], chunk_tokens):
        rows = flat[start : start + chunk_tokens]
        if track_grad:
            pieces.append(torch.utils.checkpoint.checkpoint(_entropy, rows, use_reentrant=False))
        else:
            pieces.append(_entropy(rows))
    return torch.cat(pieces).reshape(lead_shape)


def get_response_mask(
    response_ids: torch.Tensor, eos_token_id: int | list[int], dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """1 on every token up to and including the first EOS, 0 after it.

    Shapes: response_ids (B, T_r) -> (B, T_r). ``eos_token_id`` may list several EOS ids. A row without
    any EOS is all ones (the response was truncated at the length limit).

    Example: ids ``[5, 7, 2, 0, 0]`` with eos 2 -> ``[1, 1, 1, 0, 0]``.
    """
    eos_ids = torch.as_tensor(eos_token_id, device=response_ids.device).reshape(-1)
    is_eos = torch.isin(response_ids, eos_ids).to(torch.int64)
    # EOS tokens strictly before position t; the first EOS itself is still kept.
    eos_before = is_eos.cumsum(dim=-1) - is_eos
    return (eos_before == 0).to(dtype)


# ---------------------------------------------------------------------------------------------------
# Statistics over every rank of a process group (verl's helpers; every rank must call them).


def _all_reduce(value: torch.Tensor, op, group=None) -> torch.Tensor:
    torch.distributed.all_reduce(value, op=op, group=group)
    return value


def distributed_mean_max_min_std(
    local_tensor: torch.Tensor,
    compute_max: bool = True,
    compute_min: bool = True,
    compute_std: bool = True,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(mean, max, min, std)`` of the elements of ``local_tensor`` on every rank together; a
    disabled statistic is None. ``std`` is unbiased over all ``N`` elements, ``sqrt(sum (x - mean)^2 /
    (N - 1))`` (0 when N is 1). E.g. ranks holding [1] and [2]: mean 1.5, max 2, min 1, std 0.7071."""
    from torch.distributed import ReduceOp

    values = local_tensor if local_tensor.is_floating_point() else local_tensor.double()
    total = _all_reduce(values.sum(), ReduceOp.SUM, group)
    count = _all_reduce(
        torch.tensor(float(values.numel()), dtype=total.dtype, device=values.device), ReduceOp.SUM, group
    )
    mean = total / count
    gmax = _all_reduce(values.max(), ReduceOp.MAX, group) if compute_max else None
    gmin = _all_reduce(values.min(), ReduceOp.MIN, group) if compute_min else None
    std = None
    if compute_std:
        sq_dev = _all_reduce(((values - mean) ** 2).sum(), ReduceOp.SUM, group)
        std = torch.sqrt(sq_dev / torch.clamp(count - 1, min=1))
    return mean, gmax, gmin, std


def distributed_masked_mean(local_tensor: torch.Tensor, local_mask: torch.Tensor, group=None) -> torch.Tensor:
    """Mean of the masked-in elements of every rank together, ``sum(x * m) / sum(m)`` all-reduced.
    Masked-out values never count, not even as NaN (see :func:`masked_sum`). E.g. rank 0 holds [1, 2]
    under mask [1, 0] and rank 1 [3, 4] under [0, 1]: (1 + 4) / 2 = 2.5."""
    from torch.distributed import ReduceOp

    total = _all_reduce(masked_sum(local_tensor, local_mask), ReduceOp.SUM, group)
    count = _all_reduce(local_mask.sum().to(total.dtype), ReduceOp.SUM, group)
    return total / count


def expand_as_nested(tensor: torch.Tensor, nested_tensor: torch.Tensor) -> torch.Tensor:
    """Broadcast one value per row over a jagged tensor's rows (verl's helper).

    Shapes: tensor ``(B,)``, nested_tensor jagged ``(B, j)`` -> jagged ``(B, j)`` with the same
    offsets, row ``i`` filled with ``tensor[i]``. E.g. ``[1, 2]`` over rows of lengths 2 and 3 gives
    ``[[1, 1], [2, 2, 2]]``. Other shapes raise :class:`~hybridflow.errors.InvalidInputError`."""
    from hybridflow.errors import InvalidInputError

    if not nested_tensor.is_nested:
        raise InvalidInputError("expand_as_nested: nested_tensor must be a nested (jagged) tensor")
    if tensor.dim() != 1:
        raise InvalidInputError(f"expand_as_nested: tensor must be 1-D (B,), got shape {tuple(tensor.shape)}")
    if nested_tensor.dim() != 2:
        raise InvalidInputError(
            f"expand_as_nested: nested_tensor must be (B, j), got {nested_tensor.dim()} dims"
        )
    if tensor.shape[0] != nested_tensor.shape[0]:
        raise InvalidInputError(
            f"expand_as_nested: {tensor.shape[0]} values for {nested_tensor.shape[0]} rows"
        )
    offsets = nested_tensor.offsets()
    values = torch.repeat_interleave(tensor, offsets.diff(), dim=0)
    return torch.nested.nested_tensor_from_jagged(values=values, offsets=offsets)
