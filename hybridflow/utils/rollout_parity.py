"""How far the rollout engine's log-probs are from the trainer's for the same tokens (verl's
``training/rollout_probs_diff_*``). Torch only: the trainer computes it after a log-prob pass, the actor
worker during its update when the update's own log-probs are the old policy's."""

from __future__ import annotations

import torch


def compute_rollout_probs_diff(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """``|exp(rollout_log_probs) - exp(old_log_probs)|`` over valid tokens: max, mean, std (unbiased).

    All inputs (B, T_r). A large gap means the rollout engine and the trainer disagree numerically,
    which biases the importance ratios of off-policy corrections.
    """
    diff = (rollout_log_probs.float().exp() - old_log_probs.float().exp()).abs()
    diff = torch.masked_select(diff, response_mask.bool())
    prefix = "training/rollout_probs_diff"
    if diff.numel() == 0:
        return {f"{prefix}_max": 0.0, f"{prefix}_mean": 0.0, f"{prefix}_std": 0.0}
    return {
        f"{prefix}_max": diff.max().item(),
        f"{prefix}_mean": diff.mean().item(),
        f"{prefix}_std": diff.std().item() if diff.numel() > 1 else 0.0,
    }


def rollout_parity_metrics(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """:func:`compute_rollout_probs_diff` plus the same gap in log-probabilities
    (``training/rollout_log_probs_diff_max``/``_mean``), which is what parity tolerances bound."""
    metrics = compute_rollout_probs_diff(rollout_log_probs, old_log_probs, response_mask)
    log_diff = torch.masked_select(
        (rollout_log_probs.double() - old_log_probs.double()).abs(), response_mask.bool()
    )
    empty = log_diff.numel() == 0
    metrics["training/rollout_log_probs_diff_max"] = 0.0 if empty else log_diff.max().item()
    metrics["training/rollout_log_probs_diff_mean"] = 0.0 if empty else log_diff.mean().item()
    return metrics
