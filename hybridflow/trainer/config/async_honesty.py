"""Honest config for ``fully_async_main``: the settings of ``ppo_trainer.yaml`` whose effect the
fully-asynchronous trainer does not deliver, refused before Ray starts (the rule of :mod:`.honesty`).

The fully-async trainer streams groups from a rollouter (``hybridflow/trainer/fully_async``): it has no
DAPO group filter, no ReMax greedy baseline, and its replicas keep their KV caches; its old log-probs are
the rollout's own unless ``async_training`` asks for a recompute, which decides what the rollout
correction and the parity-check keys can do. :func:`fully_async_honesty_problems` says, one line per
setting, what does not hold and what to set instead. ``docs/async_training.md`` has the table of what
is honoured and what is refused.
"""

from __future__ import annotations

import functools

from omegaconf import DictConfig, OmegaConf

from hybridflow.trainer.config.checkpoint_engine import fully_async_checkpoint_engine_problems
from hybridflow.trainer.config.honesty import limited_value_problems
from hybridflow.trainer.config.profiler_honesty import fully_async_profiler_problems

# dotted key -> (the values whose effect is delivered, why other values are refused / what to do).
FULLY_ASYNC_LIMITED_VALUES: dict[str, tuple[tuple, str]] = {
    "data.gen_batch_size": (
        (1,),
        "the rollouter admits one prompt group at a time (verl's fully async requires 1 too); set 1",
    ),
    "actor_rollout_ref.rollout.mode": (
        ("async",),
        "fully_async_main always generates with agent loops on the rollouter's replicas; set async",
    ),
    "actor_rollout_ref.rollout.free_cache_engine": (
        (False,),
        "a rollouter replica keeps its KV cache between serving phases (nothing trains beside it); set false",
    ),
}
PARITY_KEYS = ("log_prob_parity_tolerance", "log_prob_parity_check_freq")


def recomputes_old_log_probs(config: DictConfig) -> bool:
    """Whether the fully-async trainer recomputes ``old_log_probs`` with its current weights (else they
    are the rollout's own, with no forward pass)."""
    asynchronous = config.async_training
    return not asynchronous.use_rollout_log_probs or bool(asynchronous.compute_prox_log_prob)


@functools.lru_cache(maxsize=1)
def _ppo_defaults() -> DictConfig:
    """``ppo_trainer.yaml``: the defaults of the keys compared here (read once; never modified)."""
    from hybridflow.trainer.config import load_schema

    return load_schema()


def fully_async_honesty_problems(config: DictConfig) -> list[str]:
    """One line per setting of the fully-async ``config`` whose effect would not be delivered."""
    schema = _ppo_defaults()
    problems = limited_value_problems(config, FULLY_ASYNC_LIMITED_VALUES)
    problems += _algorithm_problems(config, schema)
    problems += _log_prob_problems(config, schema)
    problems += _trace_problems(config, schema) + fully_async_profiler_problems(config)
    problems += fully_async_checkpoint_engine_problems(config)
    steps = (config.rollout.get("total_rollout_steps"), config.trainer.get("total_training_steps"))
    if all(steps):
        problems.append(
            f"rollout.total_rollout_steps={steps[0]} and trainer.total_training_steps={steps[1]} are both "
            "set: the run's length comes from trainer.total_training_steps and rollout.total_rollout_steps "
            "would do nothing; set one"
        )
    return problems


def _algorithm_problems(config: DictConfig, schema: DictConfig) -> list[str]:
    from hybridflow.utils.roles import ESTIMATORS_NEEDING_GREEDY_BASELINE

    problems = []
    groups = OmegaConf.to_container(config.algorithm.filter_groups, resolve=True)
    if groups != OmegaConf.to_container(schema.algorithm.filter_groups, resolve=True):
        problems.append(
            f"algorithm.filter_groups={groups} is not supported by fully_async_main: DAPO dynamic sampling "
            "(dropping zero-variance groups and generating more) is main_ppo's; the rollouter's staleness "
            "budget counts every group it admits, so it would starve the trainer. Use main_ppo, or leave "
            "algorithm.filter_groups at its defaults"
        )
    estimator = config.algorithm.adv_estimator
    if estimator in ESTIMATORS_NEEDING_GREEDY_BASELINE:
        problems.append(
            f"algorithm.adv_estimator={estimator} needs a greedy response per prompt (the ReMax baseline), "
            "which main_ppo's step generates; the rollouter streams sampled groups only. Use main_ppo, or "
            "another estimator (grpo, rloo, ...)"
        )
    return problems


def _log_prob_problems(config: DictConfig, schema: DictConfig) -> list[str]:
    """What the old log-probs' source (``async_training.use_rollout_log_probs`` /
    ``compute_prox_log_prob``) leaves the rollout correction and the parity keys able to do."""
    rollout = config.actor_rollout_ref.rollout
    correction = config.algorithm.get("rollout_correction") or {}
    decoupled = bool(correction.get("rollout_is") or correction.get("rollout_rs"))
    decoupled = decoupled and not correction.get("bypass_mode")
    problems = []
    asynchronous = config.async_training
    if asynchronous.compute_prox_log_prob and not asynchronous.use_rollout_log_probs:
        problems.append(
            "async_training.compute_prox_log_prob=true does nothing with use_rollout_log_probs=false: "
            "old_log_probs are recomputed with the trainer's current weights either way; set one of them"
        )
    if recomputes_old_log_probs(config):
        if rollout.get("use_rollout_log_probs"):
            return problems  # main_ppo's parity-checked shortcut applies to the recompute
    else:
        if decoupled:
            problems.append(
                "algorithm.rollout_correction (rollout_is / rollout_rs, decoupled mode) with "
                "async_training.use_rollout_log_probs=true and compute_prox_log_prob=false: old_log_probs "
                "would be the rollout's own log-probs, so every importance weight would be 1 and rejection "
                "would remove nothing. Set async_training.compute_prox_log_prob=true (or "
                "use_rollout_log_probs=false) to recompute them, or rollout_correction.bypass_mode=true"
            )
        if not rollout.get("calculate_log_probs", True):
            problems.append(
                "async_training.use_rollout_log_probs=true takes old_log_probs from the rollout: it needs "
                "actor_rollout_ref.rollout.calculate_log_probs=true (or set use_rollout_log_probs=false)"
            )
        if rollout.get("use_rollout_log_probs"):
            problems.append(
                "actor_rollout_ref.rollout.use_rollout_log_probs=true (main_ppo's parity-checked shortcut) "
                "does nothing here: async_training.use_rollout_log_probs=true already takes the rollout's "
                "log-probs as old_log_probs, unchecked; set one of them"
            )
    defaults = schema.actor_rollout_ref.rollout
    for key in PARITY_KEYS:
        if rollout.get(key) != defaults.get(key):
            problems.append(
                f"actor_rollout_ref.rollout.{key}={rollout.get(key)} is only read by "
                "rollout.use_rollout_log_probs=true with a recompute (async_training.use_rollout_log_probs"
                "=false or compute_prox_log_prob=true); remove it, or set those"
            )
    return problems


def _trace_problems(config: DictConfig, schema: DictConfig) -> list[str]:
    """``actor_rollout_ref.rollout.trace``: the rollout trace knows main_ppo's steps and batches; the
    rollouter's stream has neither, and no test shows a trace of it yet."""
    trace = config.actor_rollout_ref.rollout.get("trace") or {}
    default = schema.actor_rollout_ref.rollout.get("trace") or {}
    changed = sorted(key for key in trace if trace.get(key) != default.get(key))
    if not changed:
        return []
    settings = ", ".join(f"actor_rollout_ref.rollout.trace.{key}={trace.get(key)}" for key in changed)
    return [
        f"{settings}: the rollout trace is not wired into fully_async_main (its samples have no trainer "
        "step to file them under); trace with main_ppo and actor_rollout_ref.rollout.mode=async"
    ]
