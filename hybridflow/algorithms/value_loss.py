"""The clipped PPO value-function loss (Schulman et al. 2017, arXiv 1707.06347; as in verl and TRL)."""

from __future__ import annotations

import torch

from hybridflow.algorithms.loss_agg import GlobalBatchInfo, agg_loss
from hybridflow.utils.torch_functional import clip_by_value, masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``.

    Shapes: vpreds (new values), returns, values (old values), response_mask all (B, T_r). The
    global-batch arguments make ``agg`` this micro-batch's share of the mini-batch (see ``agg_loss``).
    Returns ``(vf_loss scalar, vf_clipfrac scalar)``; clipfrac is the fraction of valid tokens where the
    clipped error is the larger one (so the clipped branch is the one in the loss).
    """
    vpred_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    err_unclipped = (vpreds - returns) ** 2
    err_clipped = (vpred_clipped - returns) ** 2
    per_token = torch.max(err_unclipped, err_clipped)
    info = GlobalBatchInfo(dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    vf_loss = 0.5 * agg_loss(per_token, response_mask, loss_agg_mode, *info)
    vf_clipfrac = masked_mean(torch.gt(err_clipped, err_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac
