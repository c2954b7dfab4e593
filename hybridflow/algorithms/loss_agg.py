"""Aggregating a (B, T) per-token loss into the scalar that is back-propagated.

The mode decides how tokens and sequences are weighted (verl's ``loss_agg_mode``). A mini-batch is
split over ``dp_size`` data-parallel ranks and, on each rank, into micro-batches whose gradients
accumulate; FSDP then *averages* the gradients over the ranks. Each micro-batch therefore returns its
share of the **mini-batch** objective, multiplied by ``dp_size`` to undo that average, so the
gradient does not depend on how the mini-batch was split (verl's ``agg_loss`` with its global batch
info). With N the mini-batch's valid tokens over all ranks and G its sequences that have at least
one valid token (``batch_num_tokens`` and ``global_batch_size``; both default to this call's own
counts, i.e. the whole mini-batch in one call):

- ``token-mean``              ``sum_{i,t} l_it / N``: every token weighs the same (DAPO, 2503.14476).
- ``seq-mean-token-sum``      ``sum_i (sum_t l_it) / G``.
- ``seq-mean-token-mean``     ``sum_i (mean_t l_it) / G``: every sequence weighs the same (GRPO).
- ``seq-mean-token-sum-norm`` ``sum_i (sum_t l_it) / loss_scale_factor``: the token sums of all sequences
  divided by a constant (Dr. GRPO, arXiv 2503.20783), so neither the length nor the number of the
  responses rescales a token's gradient from batch to batch. The trainer passes the configured
  maximum response length unless ``loss_scale_factor`` is set; a bare call defaults to ``T``.

Sequences whose mask is all zero are left out of every sequence count; an empty selection
aggregates to 0 (never NaN).

Example (hand-derived): ``l = [[1, 2, 3], [4, 5, 6]]``, mask ``[[1, 1, 0], [1, 0, 0]]``: token-mean
7/3, seq-mean-token-sum 3.5, seq-mean-token-mean 2.75, seq-mean-token-sum-norm 7/3 (T = 3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from hybridflow.utils.registry import Registry
from hybridflow.utils.torch_functional import masked_mean, masked_sum


class GlobalBatchInfo(NamedTuple):
    """How one micro-batch relates to its whole mini-batch (verl's ``config.global_batch_info``)."""

    dp_size: int = 1  # data-parallel ranks whose gradients FSDP averages
    batch_num_tokens: float | None = None  # N: valid tokens of the mini-batch over all ranks
    global_batch_size: float | None = None  # G: sequences with >= 1 valid token, over all ranks
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm divisor (None: loss_mask width)


AggFn = Callable[[torch.Tensor, torch.Tensor, GlobalBatchInfo], torch.Tensor]

LOSS_AGG_MODES: Registry[AggFn] = Registry("loss aggregation mode")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce ``loss_mat`` (B, T) under ``loss_mask`` (B, T) to a scalar with the named mode (verl's
    signature; the global-batch arguments are as in :class:`GlobalBatchInfo`)."""
    info = GlobalBatchInfo(int(dp_size), batch_num_tokens, global_batch_size, loss_scale_factor)
    return LOSS_AGG_MODES.get(loss_agg_mode)(loss_mat, loss_mask, info)


def _safe_divide(total: torch.Tensor, count) -> torch.Tensor:
    """``total / count`` with 0 for an empty count (``total`` is 0 there) and a finite gradient."""
    count = torch.as_tensor(count, dtype=total.dtype, device=total.device)
    return total / torch.where(count == 0, torch.ones_like(count), count)


def _sequences(loss_mask: torch.Tensor) -> torch.Tensor:
    """(B,) 1.0 for sequences with at least one valid token."""
    return (loss_mask.sum(dim=-1) > 0).to(torch.float32)


def _seq_mean(seq_values: torch.Tensor, loss_mask: torch.Tensor, info: GlobalBatchInfo) -> torch.Tensor:
    has_tokens = _sequences(loss_mask).to(seq_values.dtype)
    count = has_tokens.sum() if info.global_batch_size is None else info.global_batch_size
    return _safe_divide(masked_sum(seq_values, has_tokens), count) * info.dp_size


@LOSS_AGG_MODES.register("token-mean")
def _token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, info: GlobalBatchInfo) -> torch.Tensor:
    count = loss_mask.sum() if info.batch_num_tokens is None else info.batch_num_tokens
    return _safe_divide(masked_sum(loss_mat, loss_mask), count) * info.dp_size


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, loss_mask, info: GlobalBatchInfo) -> torch.Tensor:
    return _seq_mean(masked_sum(loss_mat, loss_mask, axis=-1), loss_mask, info)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, loss_mask, info: GlobalBatchInfo) -> torch.Tensor:
    return _seq_mean(masked_mean(loss_mat, loss_mask, axis=-1), loss_mask, info)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, loss_mask, info: GlobalBatchInfo) -> torch.Tensor:
    # A constant divisor (neither the lengths nor the count of responses) removes GRPO's length bias.
    divisor = loss_mask.shape[-1] if info.loss_scale_factor is None else info.loss_scale_factor
    if divisor <= 0:
        raise ValueError(f"seq-mean-token-sum-norm needs loss_scale_factor > 0, got {divisor}")
    return masked_sum(loss_mat, loss_mask) / float(divisor) * info.dp_size
