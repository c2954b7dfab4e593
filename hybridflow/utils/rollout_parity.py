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


# The largest |rollout - recomputed| log-prob each rollout backend shows on the same fp32 weights
# (docs/rollout_backends.md has the measurements): below it the rollout's log-probs count as the
# trainer's own (``use_rollout_log_probs``).
PARITY_TOLERANCE = {"engine": 1e-5, "vllm": 1e-3}
# Beyond this gap the rollout sampled from other weights than the actor's (a weight sync gone wrong):
# the run stops. Rounding in bf16 legitimately reaches ~0.1-0.3, so the limit there only catches garbage.
GAP_LIMIT_FP32, GAP_LIMIT_LOW_PRECISION = 1e-2, 1.0


class RolloutLogProbGapError(RuntimeError):
    """The rollout's log-probs are far from the trainer's recompute for the same tokens."""


def parity_tolerance(rollout_cfg) -> float:
    """``rollout.log_prob_parity_tolerance``, or (null) the backend's measured gap."""
    configured = rollout_cfg.get("log_prob_parity_tolerance")
    if configured is not None:
        return float(configured)
    return PARITY_TOLERANCE.get(str(rollout_cfg.get("name", "engine")), PARITY_TOLERANCE["vllm"])


def gap_limit(rollout_cfg, all_fp32: bool) -> float | None:
    """``rollout.log_prob_gap_limit``, or (null) 1e-2 when rollout and actor both compute in fp32 and
    1.0 otherwise; a negative value turns the check off (None). Off too for greedy training rollouts
    at a temperature other than 1: their log-probs are the untempered distribution's, the recompute's
    are not, so the two are not comparable."""
    greedy = not rollout_cfg.get("do_sample", True) or float(rollout_cfg.get("temperature", 1.0)) == 0
    if greedy and float(rollout_cfg.get("temperature", 1.0)) != 1.0:
        return None
    configured = rollout_cfg.get("log_prob_gap_limit")
    if configured is None:
        return GAP_LIMIT_FP32 if all_fp32 else GAP_LIMIT_LOW_PRECISION
    return None if float(configured) < 0 else float(configured)


def check_log_prob_gap(metrics: dict, limit: float | None, step: int, backend: str) -> None:
    """Raise :class:`RolloutLogProbGapError` when this step's ``training/rollout_log_probs_diff_max``
    exceeds ``limit`` (nothing to check when the step made no parity measurement)."""
    gap = metrics.get("training/rollout_log_probs_diff_max")
    if limit is None or gap is None or gap <= limit:
        return
    raise RolloutLogProbGapError(
        f"step {step}: the {backend} rollout's log-probs differ from the actor's recompute by up to "
        f"{gap:.3g} (mean {metrics.get('training/rollout_log_probs_diff_mean', float('nan')):.3g}), beyond "
        f"rollout.log_prob_gap_limit={limit:g}: the rollout sampled from other weights than the actor's "
        "(a weight sync gone wrong). Training on it would be off-policy without correction; the run stops "
        "before this step's update is saved"
    )
