"""verl-compatible import path for the PPO-family maths (``verl.trainer.ppo.core_algos``).

The maths live in :mod:`hybridflow.algorithms`, a bottom-layer torch-only package: workers import it to
compute losses without importing the trainer (lower layers never import upper ones). This module only
re-exports those names and adds a few verl-style keyword wrappers for code ported from verl.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AdaptiveKLController,
    AdvantageFn,
    AdvantageInputs,
    AdvantageOutput,
    FixedKLController,
    KLController,
    PolicyLossConfig,
    PolicyLossFn,
    PolicyLossInputs,
    PolicyLossOutput,
    Registry,
    RegistryError,
    agg_loss,
    apply_kl_penalty_to_rewards,
    compute_advantage,
    compute_policy_loss,
    compute_value_loss,
    get_adv_estimator_fn,
    get_kl_controller,
    get_policy_loss_fn,
    kl_penalty,
    register_adv_est,
    register_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageFn",
    "AdvantageInputs",
    "AdvantageOutput",
    "FixedKLController",
    "KLController",
    "PolicyLossConfig",
    "PolicyLossFn",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "Registry",
    "RegistryError",
    "agg_loss",
    "apply_kl_penalty_to_rewards",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "register_adv_est",
    "register_policy_loss",
]


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's keyword form of the ``gae`` estimator; all tensors (B, T_r) -> (advantages, returns)."""
    inputs = AdvantageInputs(token_level_rewards, response_mask, values=values, gamma=gamma, lam=lam)
    return tuple(compute_advantage("gae", inputs))


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's keyword form of the ``grpo`` estimator; index (B,) group ids -> (advantages, returns)."""
    inputs = AdvantageInputs(
        token_level_rewards,
        response_mask,
        index=index,
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    return tuple(compute_advantage("grpo", inputs))


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's keyword form of the ``rloo`` estimator -> (advantages, returns)."""
    inputs = AdvantageInputs(token_level_rewards, response_mask, index=index)
    return tuple(compute_advantage("rloo", inputs))


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """verl's ``scores - kl_ratio * (log pi_old - log pi_ref)`` (k1 penalty, unmasked), shapes (B, T_r)."""
    return token_level_scores - kl_ratio * kl_penalty(old_log_prob, ref_log_prob, "k1")
