"""RL post-training maths: advantage estimators, policy/value losses, KL, loss aggregation.

Torch and numpy only -- no Ray, FSDP or model code -- so workers, the trainer and tests import it in
milliseconds. Every family is a ``Registry`` with one call signature; add an algorithm by decorating a
function, never by editing a dispatcher.
"""

from hybridflow.algorithms import rollout_correction  # noqa: F401  (registers the "bypass_mode" loss)
from hybridflow.algorithms.advantage import (
    ADV_ESTIMATORS,
    AdvantageFn,
    AdvantageInputs,
    AdvantageOutput,
    compute_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)
from hybridflow.algorithms.distillation import DISTILL_LOSSES, DistillConfig  # noqa: F401  (not verl's)
from hybridflow.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty_to_rewards,
    get_kl_controller,
    kl_penalty,
)
from hybridflow.algorithms.loss_agg import LOSS_AGG_MODES, GlobalBatchInfo, agg_loss
from hybridflow.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossFn,
    PolicyLossInputs,
    PolicyLossOutput,
    compute_policy_loss,
    get_policy_loss_fn,
    register_policy_loss,
)
from hybridflow.algorithms.value_loss import compute_value_loss
from hybridflow.utils.registry import Registry, RegistryError

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
    "compute_policy_loss",
    "compute_value_loss",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "register_adv_est",
    "register_policy_loss",
]
