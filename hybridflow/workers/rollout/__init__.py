"""Rollouts (generation engines) behind one interface, selected by ``actor_rollout_ref.rollout.name``."""

from hybridflow.workers.rollout import engine_rollout, hf_rollout, vllm_rollout  # noqa: F401  (register "engine", "hf", "vllm")
from hybridflow.workers.rollout.base import ROLLOUTS, BaseRollout, get_rollout_cls, register_rollout

__all__ = ["ROLLOUTS", "BaseRollout", "get_rollout_cls", "register_rollout"]
