"""verl-compatible import path for the PPO-family maths (``verl.trainer.ppo.core_algos``).

The maths live in :mod:`hybridflow.algorithms`, a bottom-layer torch-only package: workers import it to
compute losses without importing the trainer (lower layers never import upper ones). This module gives a
verl user's recipe the names it imports — ``register_adv_est``, ``get_adv_estimator_fn``,
``AdvantageEstimator``, ``register_policy_loss``, ``get_policy_loss_fn``, ``agg_loss``,
``compute_*_advantage`` / ``compute_policy_loss_*``, ``kl_penalty``, ``compute_entropy_loss``, ... —
with verl's call signatures. The registries are the same objects the trainer dispatches through.
"""

from __future__ import annotations

from enum import StrEnum

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
    GlobalBatchInfo,
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
    get_kl_controller,
    get_policy_loss_fn,
    kl_penalty,
    register_policy_loss,
)
from hybridflow.algorithms.advantage import (
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from hybridflow.algorithms.policy_loss import (
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
)

# verl's bypass-mode loss (algorithm.rollout_correction.bypass_mode)
from hybridflow.algorithms.rollout_correction import bypass_policy_loss as compute_policy_loss_bypass_mode
from hybridflow.utils.registry import lookup_in, register_in
from hybridflow.utils.torch_functional import entropy_from_logits

# Every estimator here is vectorised; verl's names for its vectorised versions are the same functions.
compute_grpo_vectorized_outcome_advantage = compute_grpo_outcome_advantage
compute_rloo_vectorized_outcome_advantage = compute_rloo_outcome_advantage

POLICY_LOSS_REGISTRY = POLICY_LOSSES  # verl's module-level names for the registries
ADV_ESTIMATOR_REGISTRY = ADV_ESTIMATORS


def register_adv_est(name_or_enum, *aliases):
    """verl's decorator: register an estimator under a name (or an Enum's ``.value``).

    It registers into this module's ``ADV_ESTIMATOR_REGISTRY`` as bound at call time (the trainer's
    registry, unless code rebinds the name, as verl's own tests do). Registering a different function
    under a taken name raises a ``ValueError``; the same function again is a no-op."""
    return register_in(ADV_ESTIMATOR_REGISTRY, "advantage estimator", name_or_enum, *aliases)


def get_adv_estimator_fn(name_or_enum):
    """verl's lookup: the estimator registered under ``name_or_enum`` (case-sensitive). An unknown
    name raises a ``ValueError`` worded as verl's (``Unknown advantage estimator simply: <name>``),
    followed by the registered names."""
    return lookup_in(
        ADV_ESTIMATOR_REGISTRY, name_or_enum, f"Unknown advantage estimator simply: {name_or_enum}"
    )


class AdvantageEstimator(StrEnum):
    """verl's enum of the built-in estimator names; ``register_adv_est`` / ``get_adv_estimator_fn``
    accept its members (their ``.value`` is the registry key)."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"


__all__ = [
    "ADV_ESTIMATORS",
    "ADV_ESTIMATOR_REGISTRY",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageFn",
    "AdvantageInputs",
    "AdvantageOutput",
    "FixedKLController",
    "GlobalBatchInfo",
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
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "register_adv_est",
    "register_policy_loss",
]


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """verl's ``scores - kl_ratio * (log pi_old - log pi_ref)`` (k1 penalty, unmasked), shapes (B, T_r)."""
    return token_level_scores - kl_ratio * kl_penalty(old_log_prob, ref_log_prob, "k1")


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Entropy of ``logits`` (B, T_r, V) aggregated under ``response_mask`` (B, T_r) (verl's helper)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
