"""Load and validate the trainer config before anything starts.

``ppo_trainer.yaml`` is the single source of truth for key names and defaults. A composed config
(CLI overrides, or a user YAML that lists ``ppo_trainer`` in its defaults) is checked against it:
unknown keys (with the nearest valid key), sizes and counts that are not positive, impossible batch
divisibility, missing files, unregistered algorithm names and settings
whose effect hybridflow does not deliver (:mod:`.honesty`) are all collected and reported in one
:class:`ConfigError` before Ray starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from hybridflow.trainer.config.schema import CONFIG_DIR, FREE_FORM_KEYS, unknown_keys  # noqa: F401

# verl's typed sections, defined beside the code that reads them (lower layers) and importable from
# here, verl's path: ``from hybridflow.trainer.config import AlgoConfig``. Loaded on first use.
_TYPED_SECTIONS = {
    "AlgoConfig": "hybridflow.algorithms.config",
    "FilterGroupsConfig": "hybridflow.algorithms.config",
    "KLControlConfig": "hybridflow.algorithms.config",
    "RolloutCorrectionConfig": "hybridflow.algorithms.config",
    "BaseConfig": "hybridflow.utils.config",
    "omega_conf_to_dataclass": "hybridflow.utils.config",
}


def __getattr__(name: str):
    if name in _TYPED_SECTIONS:
        return getattr(importlib.import_module(_TYPED_SECTIONS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TYPED_SECTIONS))


class ConfigError(ValueError):
    """One or more problems with the config, each on its own line."""


def load_schema() -> DictConfig:
    return OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml")


def load_config(
    overrides: list[str] | None = None,
    config_name: str = "ppo_trainer",
    config_dir: str | os.PathLike | None = None,
) -> DictConfig:
    """Compose the config exactly as ``main_ppo`` does (Hydra), with verl-style ``key=value``
    overrides; an override of a key that does not exist is a :class:`ConfigError` naming the nearest
    valid key."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    with initialize_config_dir(config_dir=str(Path(config_dir or CONFIG_DIR).resolve()), version_base=None):
        try:
            return compose(config_name=config_name, overrides=list(overrides or []))
        except ConfigCompositionException as err:
            from hybridflow.trainer.config.mistakes import override_problems

            misspelled = override_problems(list(overrides or []), config_name, [config_dir])
            if misspelled:  # the nearest valid key, rather than Hydra's "not in struct"
                raise ConfigError("invalid config:\n  - " + "\n  - ".join(misspelled)) from err
            raise ConfigError(f"{err}: {err.__cause__}" if err.__cause__ else str(err)) from err


def validate_config(config: DictConfig) -> None:
    """Raise :class:`ConfigError` listing every problem found."""
    from hybridflow.trainer.config.honesty import honesty_problems
    from hybridflow.trainer.config.mistakes import (
        BATCH_KEYS,
        bad_sizes,
        range_problems,
        size_problems,
        unknown_key_problems,
        value_problems,
    )

    schema = load_schema()
    problems = unknown_key_problems(config, schema, "ppo_trainer.yaml") + value_problems(config, schema)
    sizes = bad_sizes(config)  # a size that is not positive: named as such, not as "not divisible"
    problems += size_problems(sizes) + range_problems(config)
    checks = (
        _check_files,
        _check_placement,
        _check_batch_sizes,
        _check_names,
        _check_device,
        _check_unsupported,
        _check_failure_settings,
        honesty_problems,
    )
    for check in checks:
        if check is _check_batch_sizes and BATCH_KEYS.intersection(sizes):
            continue
        try:
            problems.extend(check(config))
        except (ArithmeticError, TypeError, ValueError):
            if not sizes:
                raise
            # the check computes with a size named above (0, a negative, a string): that line is the fix
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def _paths(value) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, (list, ListConfig)) else [str(value)]


def _check_files(config: DictConfig) -> list[str]:
    problems = []
    for key in ("train_files", "val_files"):
        for path in _paths(config.data[key]):
            if not os.path.isfile(os.path.expanduser(path)):
                problems.append(f"data.{key}: file {path!r} does not exist")
    model_path = os.path.expanduser(str(config.actor_rollout_ref.model.path))
    if not os.path.isdir(model_path):
        problems.append(f"actor_rollout_ref.model.path: {model_path!r} is not a local model directory")
    if config.custom_reward_function.path and not os.path.isfile(
        os.path.expanduser(config.custom_reward_function.path)
    ):
        problems.append(f"custom_reward_function.path: {config.custom_reward_function.path!r} does not exist")
    custom_cls = config.data.custom_cls.get("path")
    if custom_cls and not os.path.isfile(os.path.expanduser(str(custom_cls))):
        problems.append(f"data.custom_cls.path: {custom_cls!r} does not exist")
    return problems


def _check_placement(config: DictConfig) -> list[str]:
    from hybridflow.placement.spec import placement_problems

    return placement_problems(config)


def _check_batch_sizes(config: DictConfig) -> list[str]:
    """Batch sizes split evenly over each role's workers (its pool: ``trainer.placement``)."""
    from hybridflow.placement.spec import batch_problems, placement_from_config, placement_problems

    if placement_problems(config):  # reported by _check_placement
        return []
    if config.trainer.placement == "auto" and not config.trainer.resource_pool_spec:
        return []  # the planner only proposes placements these sizes divide
    return batch_problems(config, placement_from_config(config))


def _check_names(config: DictConfig) -> list[str]:
    from hybridflow.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES

    actor = config.actor_rollout_ref.actor
    wanted = [
        (ADV_ESTIMATORS, config.algorithm.adv_estimator, "algorithm.adv_estimator"),
        (POLICY_LOSSES, actor.policy_loss.loss_mode, "actor.policy_loss.loss_mode"),
        (LOSS_AGG_MODES, actor.loss_agg_mode, "actor.loss_agg_mode"),
        (KL_ESTIMATORS, actor.kl_loss_type, "actor.kl_loss_type"),
        (KL_ESTIMATORS, config.algorithm.kl_penalty, "algorithm.kl_penalty"),
    ]
    problems = []
    for registry, name, key in wanted:
        if name not in registry:
            problems.append(f"{key}={name!r} is not registered; registered: {', '.join(registry.names())}")
    return problems + _check_plugin_names(config)


def _check_plugin_names(config: DictConfig) -> list[str]:
    import hybridflow.workers.rollout  # noqa: F401  (registers the built-in rollouts)
    from hybridflow.workers.reward_manager import REWARD_MANAGERS
    from hybridflow.workers.rollout.base import ROLLOUTS

    problems = []
    name = config.actor_rollout_ref.rollout.name
    if name not in ROLLOUTS and name != "sglang":  # sglang: honesty.py says why it is not here
        problems.append(
            f"rollout.name={config.actor_rollout_ref.rollout.name!r} is not registered; "
            f"registered: {', '.join(ROLLOUTS.names())}"
        )
    manager = config.reward_model.reward_manager
    in_loop = config.reward_model.get("use_reward_loop", False)  # the loop's managers: reward_loop_honesty
    if manager not in REWARD_MANAGERS and not in_loop:
        problems.append(
            f"reward_model.reward_manager={manager!r} is not registered; "
            f"registered: {', '.join(REWARD_MANAGERS.names())}"
        )
    return problems


def _check_device(config: DictConfig) -> list[str]:
    trainer = config.trainer
    # The driver can only see its own node's GPUs: check the count when every worker runs here.
    local = int(trainer.nnodes) == 1 and str(config.ray_init.get("address", "local")) == "local"
    workers = int(trainer.n_gpus_per_node) if local else None
    return device_problems(str(trainer.device), workers)


def device_problems(device: str, local_workers: int | None = None) -> list[str]:
    """Why ``trainer.device`` cannot be used here (empty when it can). ``local_workers``: worker
    processes that will run on this machine (one GPU each on CUDA); None when they run elsewhere (a
    cluster joined through Ray), where the driver's own GPUs say nothing."""
    if device not in ("cpu", "cuda"):
        return [f"trainer.device must be cpu or cuda, not {device!r}"]
    if device == "cuda" and local_workers is not None:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == 0:
            return ["trainer.device=cuda but no CUDA device is visible (use trainer.device=cpu)"]
        if local_workers > visible:
            return [
                f"trainer.n_gpus_per_node={local_workers} worker processes need one GPU each, but {visible} "
                f"GPU(s) are visible here (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            ]
    return []


def _check_unsupported(config: DictConfig) -> list[str]:
    problems = []
    rollout = config.actor_rollout_ref.rollout
    if int(rollout.log_prob_parity_check_freq) < 1:
        problems.append(
            f"rollout.log_prob_parity_check_freq must be >= 1 (steps between parity checks of "
            f"use_rollout_log_probs), got {rollout.log_prob_parity_check_freq}"
        )
    for key in ("log_prob_parity_tolerance", "log_prob_gap_limit"):
        value = rollout.get(key)
        if value is not None and not isinstance(value, int | float):
            problems.append(f"rollout.{key} must be null or a number, got {value!r}")
    threads = rollout.get("decode_threads")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        problems.append(f"rollout.decode_threads must be null or an integer >= 1, got {threads!r}")
    per_sync = rollout.get("decode_steps_per_sync")
    if per_sync is not None and (not isinstance(per_sync, int) or per_sync < 1):
        problems.append(f"rollout.decode_steps_per_sync must be null or an integer >= 1, got {per_sync!r}")
    if rollout.multi_turn.enable:
        if rollout.name not in ("engine", "vllm"):
            problems.append(
                f"rollout.multi_turn.enable=true needs rollout.name=engine or vllm, not {rollout.name!r}"
            )
        path = rollout.multi_turn.get("tool_config_path")
        if path and not os.path.isfile(os.path.expanduser(str(path))):
            problems.append(f"rollout.multi_turn.tool_config_path: {path!r} is not a file")
    problems += _tool_problems(rollout) + _interaction_problems(rollout) + _engine_model_problems(config)
    problems += _check_lora(config.actor_rollout_ref.model)
    return problems + _agent_loop_problems(config) + _rollout_correction_problems(config)


def _engine_model_problems(config: DictConfig) -> list[str]:
    """``rollout.name=engine`` on a model the engine does not serve (a family outside
    docs/model_support.md's support table, a Qwen family's sliding window), refused now rather than when
    the workers build it: read from the model directory's config.json."""
    import json

    if config.actor_rollout_ref.rollout.name != "engine":
        return []
    file = os.path.join(os.path.expanduser(str(config.actor_rollout_ref.model.path)), "config.json")
    if not os.path.isfile(file):
        return []
    with open(file) as handle:
        raw = json.load(handle)
    if "vision_config" in raw:  # a vision-language model: the engine holds its Qwen2 language model
        return []
    from hybridflow.workers.rollout.engine.model import engine_refusal

    refusal = engine_refusal(raw)
    return [f"actor_rollout_ref.rollout.name=engine: {refusal}"] if refusal else []


def _tool_problems(rollout: DictConfig) -> list[str]:
    """``multi_turn.tool_config_path``: every entry's class imports (a verl tool we do not have is
    refused by name), its schema or MCP servers file is there; no tool is built, no server called."""
    path = rollout.multi_turn.get("tool_config_path")
    if not path or not os.path.isfile(os.path.expanduser(str(path))):
        return []  # unset, or refused above
    from hybridflow.workers.rollout.tools.registry import ToolConfigError, check_tool_config

    try:
        check_tool_config(os.path.expanduser(str(path)))
    except ToolConfigError as error:
        return [f"rollout.multi_turn.tool_config_path: {error}"]
    return []


def _interaction_problems(rollout: DictConfig) -> list[str]:
    """``multi_turn.interaction_config_path``: read by the multi-turn machine (``multi_turn.enable``,
    or the ``tool_agent`` loop of ``rollout.mode=async``); its file loads and every class imports."""
    path = rollout.multi_turn.get("interaction_config_path")
    if not path:
        return []
    if not rollout.multi_turn.enable and rollout.get("mode") != "async":
        return [
            "rollout.multi_turn.interaction_config_path is set but nothing runs interactions: set "
            "rollout.multi_turn.enable=true (or rollout.mode=async with the tool_agent loop)"
        ]
    from hybridflow.workers.rollout.interactions.registry import InteractionConfigError, interaction_specs

    try:
        interaction_specs(os.path.expanduser(str(path)))
    except InteractionConfigError as error:
        return [f"rollout.multi_turn.interaction_config_path: {error}"]
    return []


def _rollout_correction_problems(config: DictConfig) -> list[str]:
    from hybridflow.algorithms.rollout_correction import RolloutCorrection

    section = config.algorithm.get("rollout_correction")
    correction = RolloutCorrection.from_config(section) if section else None
    if correction is None:
        return []
    problems = [f"algorithm.rollout_correction.{line}" for line in correction.problems()]
    if not config.actor_rollout_ref.rollout.get("calculate_log_probs", True):
        problems.append(
            "algorithm.rollout_correction needs the rollout's log-probs: rollout.calculate_log_probs=true"
        )
    return problems


def apply_rollout_correction_mode(config: DictConfig) -> None:
    """``rollout_correction.bypass_mode``: the actor's policy loss becomes verl's ``bypass_mode`` loss and
    carries the correction settings (set before the workers receive their config)."""
    section = config.algorithm.get("rollout_correction")
    if not section or not section.get("bypass_mode"):
        return
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    with open_dict(policy_loss):
        policy_loss.loss_mode = "bypass_mode"
        policy_loss.rollout_correction = OmegaConf.to_container(section, resolve=True)


def _agent_loop_problems(config: DictConfig) -> list[str]:
    """``rollout.mode``: sync, or async with agent loops that exist — the default one and every name in
    the data's ``agent_name`` column, checked before the first step."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.mode not in ("sync", "async"):
        return [f"rollout.mode={rollout.mode!r}: use sync or async"]
    if rollout.mode == "sync":
        return []
    from hybridflow.workers.rollout.agent_loop.base import (
        agent_loop_class,
        load_agent_loop_configs,
        registered_agent_loops,
    )
    from hybridflow.workers.rollout.agent_loop.worker import default_agent_loop

    problems = []
    if (
        int(rollout.get("tensor_model_parallel_size") or 1) > 1
        or int(config.actor_rollout_ref.actor.get("tensor_model_parallel_size") or 1) > 1
    ):
        problems.append(
            "rollout.mode=async serves one engine per rank: rollout and actor "
            "tensor_model_parallel_size must be 1"
        )
    if int(rollout.agent.num_workers) < 1:
        problems.append(f"rollout.agent.num_workers must be >= 1, got {rollout.agent.num_workers}")
    try:
        load_agent_loop_configs(rollout.agent.get("agent_loop_config_path"))
    except Exception as error:  # a bad YAML
        return [*problems, f"rollout.agent.agent_loop_config_path: {type(error).__name__}: {error}"]
    for name in sorted({default_agent_loop(rollout)} | _agent_names(config.data)):
        try:
            agent_loop_class(name)
        except KeyError:
            problems.append(
                f"agent loop {name!r} (rollout.agent or the data's agent_name column) is not registered; "
                f"registered: {registered_agent_loops()}"
            )
        except (ImportError, AttributeError, TypeError) as error:
            problems.append(f"agent loop {name!r} does not load: {type(error).__name__}: {error}")
    return problems


def _agent_names(data_cfg) -> set[str]:
    """The values of the ``agent_name`` column of the train and val files (empty when absent)."""
    import pyarrow.parquet as pq

    names: set[str] = set()
    for key in ("train_files", "val_files"):
        files = data_cfg.get(key)
        for path in [files] if isinstance(files, str) else list(files or []):
            path = os.path.expanduser(str(path))
            if os.path.isfile(path) and "agent_name" in pq.read_schema(path).names:
                column = pq.read_table(path, columns=["agent_name"]).column("agent_name").to_pylist()
                names.update(str(name) for name in column if name)
    return names


TIMEOUT_KEYS = (
    "reward_model.score_timeout_s",
    "reward_model.batch_timeout_s",
    "actor_rollout_ref.rollout.multi_turn.tool_timeout_s",
)


def _check_failure_settings(config: DictConfig) -> list[str]:
    """Time limits are positive seconds or null (no limit); save_on_preempt is a bool."""
    problems = []
    for key in TIMEOUT_KEYS:
        value = OmegaConf.select(config, key)
        positive = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if value is not None and not positive:
            problems.append(f"{key}={value!r}: use a positive number of seconds, or null for no limit")
    if not isinstance(config.trainer.get("save_on_preempt", True), bool):
        problems.append(f"trainer.save_on_preempt={config.trainer.save_on_preempt!r}: use true or false")
    return problems


def _check_lora(model_cfg: DictConfig) -> list[str]:
    if int(model_cfg.get("lora_rank", 0) or 0) <= 0:
        return []
    problems = []
    if float(model_cfg.get("lora_alpha", 16)) <= 0:
        problems.append(f"model.lora_alpha must be > 0, got {model_cfg.lora_alpha}")
    adapter = model_cfg.get("lora_adapter_path")
    if adapter and not os.path.isfile(os.path.join(os.path.expanduser(str(adapter)), "adapter_config.json")):
        problems.append(f"model.lora_adapter_path: no adapter_config.json in {adapter!r}")
    if importlib.util.find_spec("peft") is None:
        problems.append("model.lora_rank > 0 needs peft: pip install -e '.[models]'")
    return problems
