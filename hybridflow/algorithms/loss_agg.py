"""Aggregating a (B, T) per-token loss into the scalar that is back-propagated.

The mode decides how tokens and sequences are weighted (verl's ``loss_agg_mode``):

- ``token-mean``              sum over all valid tokens / number of valid tokens (DAPO, arXiv 2503.14476).
- ``seq-mean-token-sum``      mean over sequences of each sequence's token sum.
- ``seq-mean-token-mean``     mean over sequences of each sequence's token mean (original GRPO).
- ``seq-mean-token-sum-norm`` mean over sequences of the token sum, divided by a constant
  ``loss_scale_factor`` (default: the padded response length T) -- Dr. GRPO (arXiv 2503.20783).

As in current verl, sequences whose mask is all zero are left out of every sequence mean; an entirely
masked batch aggregates to 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.utils.registry import Registry
from hybridflow.utils.torch_functional import masked_mean

AggFn = Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]

LOSS_AGG_MODES: Registry[AggFn] = Registry("loss aggregation mode")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce ``loss_mat`` (B, T) under ``loss_mask`` (B, T) to a scalar with the named mode."""
    return LOSS_AGG_MODES.get(loss_agg_mode)(loss_mat, loss_mask, loss_scale_factor)


def _seq_mean(seq_values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of per-sequence values (B,) over the sequences that have at least one valid token."""
    has_tokens = (loss_mask.sum(dim=-1) > 0).to(seq_values.dtype)
    return masked_mean(seq_values, has_tokens)


@LOSS_AGG_MODES.register("token-mean")
def _token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_scale_factor=None) -> torch.Tensor:
    return masked_mean(loss_mat, loss_mask)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, loss_mask, loss_scale_factor=None) -> torch.Tensor:
    return _seq_mean((loss_mat * loss_mask).sum(dim=-1), loss_mask)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, loss_mask, loss_scale_factor=None) -> torch.Tensor:
    return _seq_mean(masked_mean(loss_mat, loss_mask, axis=-1), loss_mask)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, loss_mask, loss_scale_factor=None) -> torch.Tensor:
    # A constant divisor (not the sequence length) removes GRPO's length bias; keep it fixed across steps.
    divisor = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return _seq_mean_token_sum(loss_mat, loss_mask) / divisor
