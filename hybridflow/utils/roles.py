"""Which roles and phases a run's config needs: facts about the algorithm config, read by the
placement (which roles get a pool), the config checks, checkpointing (which models are saved) and the
trainer (which phases a step runs). Pure config reading: no torch, no Ray.

Roles (verl's ``Role``): ``actor_rollout`` (the hybrid actor + rollout engine, always present),
``ref`` (the reference policy, for a KL loss or a KL penalty in the reward), ``critic`` (for an
estimator that reads values), ``rm`` (a model reward: the reward-model worker; with the reward loop
on, the reward model is served instead, :func:`served_reward_model`, and takes no role here).
"""

from __future__ import annotations

from omegaconf import DictConfig

ROLES = ("actor_rollout", "ref", "critic", "rm")
# Estimators that read the critic's values; the critic is built only when one of them is selected.
ESTIMATORS_NEEDING_VALUES = frozenset({"gae"})
# Estimators whose baseline is the reward of a greedy response to the same prompt (``reward_baselines``).
ESTIMATORS_NEEDING_GREEDY_BASELINE = frozenset({"remax"})


def need_critic(config: DictConfig) -> bool:
    """``critic.enable`` when set, else whether the advantage estimator reads values."""
    if config.critic.get("enable") is not None:
        return bool(config.critic.enable)
    return config.algorithm.adv_estimator in ESTIMATORS_NEEDING_VALUES


def need_reference(config: DictConfig) -> bool:
    """A reference policy: for the actor's KL loss or the KL penalty in the reward."""
    return bool(config.actor_rollout_ref.actor.use_kl_loss or config.algorithm.use_kl_in_reward)


def roles_in_use(config: DictConfig) -> list[str]:
    """The roles this run builds, in :data:`ROLES` order."""
    used = {"actor_rollout": True, "ref": need_reference(config), "critic": need_critic(config)}
    used["rm"] = reward_model_worker(config)
    return [role for role in ROLES if used[role]]


def served_reward_model(config: DictConfig) -> bool:
    """``reward_model.enable`` with ``use_reward_loop``: main_ppo serves the reward model itself
    (``hybridflow.serve`` replicas behind a router), no reward-model worker."""
    rm = config.reward_model
    return bool(rm.get("enable", False)) and bool(rm.get("use_reward_loop", False))


def reward_model_worker(config: DictConfig) -> bool:
    """The ``rm`` role: a reward-model worker scoring the batch (``reward_model.enable``, loop off)."""
    return bool(config.reward_model.get("enable", False)) and not served_reward_model(config)


def update_computes_old_log_probs(config: DictConfig) -> bool:
    """Whether the actor update's own forward is provably the old policy's, so its log-probs
    (detached) are ``old_log_probs`` and the separate old-log-prob pass is skipped (TRL and verl's
    on-policy shortcut): one PPO epoch and one mini-batch per step (the whole batch is one optimizer
    step, so every micro-batch sees the weights that generated it), and nothing needs them before the
    update (no KL penalty in the reward; ``use_rollout_log_probs`` asks for the engine's instead).
    Exact: ratio = exp(log pi - sg(log pi)) = 1, gradient = grad log pi."""
    actor = config.actor_rollout_ref.actor
    return (
        bool(actor.get("reuse_update_log_probs", True))
        and int(actor.ppo_epochs) == 1
        and int(actor.ppo_mini_batch_size) == int(config.data.train_batch_size)
        and not bool(config.algorithm.use_kl_in_reward)
        and not bool(config.actor_rollout_ref.rollout.get("use_rollout_log_probs", False))
        and not rollout_correction_enabled(config)  # it compares old_log_probs with the rollout's first
    )


def rollout_correction_enabled(config: DictConfig) -> bool:
    """Whether ``algorithm.rollout_correction`` turns anything on (IS weights, rejection, bypass)."""
    section = config.algorithm.get("rollout_correction") or {}
    return bool(section.get("rollout_is") or section.get("rollout_rs") or section.get("bypass_mode"))
