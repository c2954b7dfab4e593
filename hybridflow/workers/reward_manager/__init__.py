"""Reward managers: turn a batch of generated responses into token-level scores.

A manager is called as ``manager(data: DataProto, return_dict=False)`` and returns
``reward_tensor (B, T_r) float32`` with each sample's score on its last generated token (the last
position where ``response_mask == 1``), or ``{"reward_tensor", "reward_extra_info"}``. Managers are
registered by name: ``naive`` (one scorer call per sample), ``batch`` (one call for the batch),
``dapo`` (naive + overlong penalty), ``prime`` (parallel worker processes it can kill). Every manager
limits each scorer call to ``score_timeout_s`` and a batch's scoring to ``batch_timeout_s``
(:mod:`.timeouts`). Build one from config with :func:`build_reward_manager`.
"""

from hybridflow.workers.reward_manager import batch, dapo, naive, prime  # noqa: F401  (registration)
from hybridflow.workers.reward_manager.batch import BatchRewardManager
from hybridflow.workers.reward_manager.custom import (
    CustomRewardFunction,
    build_reward_manager,
    load_custom_reward_function,
)
from hybridflow.workers.reward_manager.dapo import DAPORewardManager
from hybridflow.workers.reward_manager.naive import NaiveRewardManager, RewardScoreError
from hybridflow.workers.reward_manager.prime import PrimeRewardManager
from hybridflow.workers.reward_manager.registry import (
    REWARD_MANAGER_REGISTRY,
    REWARD_MANAGERS,
    get_reward_manager_cls,
    register,
    register_reward_manager,
)
from hybridflow.workers.reward_manager.timeouts import ScoreTimeout

__all__ = [
    "REWARD_MANAGER_REGISTRY",
    "REWARD_MANAGERS",
    "BatchRewardManager",
    "CustomRewardFunction",
    "DAPORewardManager",
    "NaiveRewardManager",
    "PrimeRewardManager",
    "RewardScoreError",
    "ScoreTimeout",
    "build_reward_manager",
    "get_reward_manager_cls",
    "load_custom_reward_function",
    "register",
    "register_reward_manager",
]
