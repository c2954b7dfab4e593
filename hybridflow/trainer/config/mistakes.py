"""Common config mistakes, each answered with the fix: a misspelled key (the nearest valid key, from the
entry point's schema) and a size or count that is not a positive integer (named with its value, before
the divisibility checks that would otherwise give the wrong reason).

Used by :func:`hybridflow.trainer.config.validate_config` and the other entry points' validators, by
:func:`hybridflow.trainer.config.load_config`, and by the command-line check of
:mod:`hybridflow.trainer.hydra_entry`, which answers an override of a key that does not exist before
Hydra's own "not in struct" message (whose ``+key=`` suggestion only leads to a second error).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

# The key tree each entry point's validation accepts (its config name -> the YAML files that define it).
ENTRY_SCHEMAS = {
    "ppo_trainer": ("ppo_trainer.yaml",),
    "fully_async_ppo_trainer": ("ppo_trainer.yaml", "fully_async_ppo_trainer.yaml"),
    "generation": ("generation.yaml",),
    "evaluation": ("evaluation.yaml",),
    "sft_trainer": ("sft_trainer.yaml",),
}


def entry_schema(config_name: str) -> DictConfig:
    """The key tree of an entry point's config (``ppo_trainer``'s for a user YAML built on it)."""
    from hybridflow.trainer.config.schema import CONFIG_DIR

    files = ENTRY_SCHEMAS.get(config_name, ENTRY_SCHEMAS["ppo_trainer"])
    parts = []
    for name in files:
        part = OmegaConf.load(CONFIG_DIR / name)
        part.pop("defaults", None)  # a Hydra defaults list: the files it names come first here
        parts.append(part)
    return parts[0] if len(parts) == 1 else OmegaConf.merge(*parts)


def schema_file(config_name: str) -> str:
    return f"{config_name}.yaml" if config_name in ENTRY_SCHEMAS else "ppo_trainer.yaml"


# ------------------------------------------------------------------------------------- misspelled keys
def key_paths(schema: DictConfig) -> list[str]:
    """Every dotted key path of ``schema`` (sections and leaves)."""
    paths: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            paths.append(path)
            if isinstance(value, dict):
                walk(value, f"{path}.")

    walk(OmegaConf.to_container(schema, resolve=False), "")
    return paths


def nearest_key(key: str, paths: list[str]) -> str | None:
    """The valid key ``key`` most likely meant: a close sibling first (same section), else the closest
    whole path (a misspelled section, or the key under another section). None when nothing is close."""
    parent, _, leaf = key.rpartition(".")
    siblings = {p.rpartition(".")[2]: p for p in paths if p.rpartition(".")[0] == parent and p != key}
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.7)
    if close:
        return siblings[close[0]]
    close = difflib.get_close_matches(key, paths, n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_key_message(key: str, paths: list[str], schema_name: str) -> str:
    """``unknown config key 'k' (not in X.yaml)``, with ``; did you mean 'k2'?`` when a valid key is close."""
    message = f"unknown config key {key!r} (not in {schema_name})"
    near = nearest_key(key, paths)
    return f"{message}; did you mean {near!r}?" if near else message


def unknown_key_problems(
    config: DictConfig, schema: DictConfig, schema_name: str, sections=None
) -> list[str]:
    """One line per key of ``config`` that ``schema`` does not have (free-form sections excepted), each
    with the nearest valid key; ``sections``: only these top-level sections."""
    from hybridflow.trainer.config.schema import unknown_keys

    if sections is None:
        found = unknown_keys(config, schema)
    else:
        found = [k for s in sections for k in unknown_keys(config[s], schema[s], f"{s}.")]
    if not found:
        return []
    paths = key_paths(schema)
    return [unknown_key_message(key, paths, schema_name) for key in found]


def override_problems(overrides: list[str], config_name: str, config_dirs=()) -> list[str]:
    """Command-line overrides (``key=value``, ``+key=value``, ``++key=value``) of keys that the entry
    point's validation refuses, each with the nearest valid key. Keys under free-form sections, Hydra's
    own (``hydra.*``), config groups (a folder of that name in ``config_dirs``) and deletions are left to
    Hydra and the validators; so is an override Hydra cannot parse (Hydra says why)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hybridflow.trainer.config.schema import CONFIG_DIR

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # a syntax error: Hydra's message names it
        return []
    groups = {CONFIG_DIR}
    for folder in (Path(os.path.expanduser(str(d))) for d in config_dirs if d):
        groups |= {folder, CONFIG_DIR.parent / folder}  # relative: to the working or the entry's folder
    schema, paths, problems = None, None, []
    for override in parsed:
        key = override.key_or_group
        if override.is_delete() or override.package is not None or "/" in key:
            continue
        if key.split(".")[0] == "hydra" or any((folder / key).is_dir() for folder in groups):
            continue
        if schema is None:
            schema = entry_schema(config_name)
        if _is_refused(schema, key):
            paths = paths if paths is not None else key_paths(schema)
            problems.append(unknown_key_message(key, paths, schema_file(config_name)))
    return problems


def _is_refused(schema: DictConfig, key: str) -> bool:
    """Whether the dotted ``key`` is missing from ``schema`` where validation refuses unknown keys."""
    from hybridflow.trainer.config.schema import FREE_FORM_KEYS

    node = schema
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            return False  # below a null / scalar default: Hydra and the validators decide
        if part not in node.keys():
            return True
        if part in FREE_FORM_KEYS:
            return False
        node = node._get_node(part)
    return False


# ---------------------------------------------------------------------------------- sizes and counts
# Sizes and counts that must be positive integers (PPO trainer): always, and where set (null: unset).
POSITIVE_KEYS = (
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.max_num_batched_tokens",
    "trainer.total_epochs",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
)
POSITIVE_WHERE_SET_KEYS = (
    "data.val_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.block_size",
    "trainer.total_training_steps",
)
CRITIC_KEYS = ("critic.ppo_mini_batch_size", "critic.ppo_epochs")  # only when a critic is built
CRITIC_WHERE_SET_KEYS = (
    "critic.ppo_micro_batch_size",
    "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size",
    "critic.forward_micro_batch_size_per_gpu",
)
REWARD_MODEL_WHERE_SET_KEYS = ("reward_model.micro_batch_size", "reward_model.micro_batch_size_per_gpu")

# The sizes the batch-divisibility check (placement.spec.batch_problems) computes with: when one of them
# is not positive, that line is the reason, and "not divisible" lines would name the wrong one.
BATCH_KEYS = frozenset(
    {
        "data.train_batch_size",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "critic.ppo_mini_batch_size",
        "critic.ppo_micro_batch_size_per_gpu",
        "trainer.nnodes",
        "trainer.n_gpus_per_node",
    }
)


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def bad_sizes(config: DictConfig) -> dict[str, object]:
    """``{key: value}`` of the PPO config's sizes and counts that are not positive integers."""
    from hybridflow.utils.roles import need_critic

    required, where_set = list(POSITIVE_KEYS), list(POSITIVE_WHERE_SET_KEYS)
    try:
        critic = need_critic(config)
    except Exception:  # an unknown estimator name: reported by _check_names
        critic = False
    if critic:
        required += CRITIC_KEYS
        where_set += CRITIC_WHERE_SET_KEYS
    if config.get("reward_model") is not None and config.reward_model.get("enable"):
        where_set += REWARD_MODEL_WHERE_SET_KEYS
    bad = {}
    for key in required:
        value = OmegaConf.select(config, key, default=None)
        if not is_positive_int(value):
            bad[key] = value
    for key in where_set:
        value = OmegaConf.select(config, key, default=None)
        if value is not None and not is_positive_int(value):
            bad[key] = value
    # rollout.response_length is ${data.max_response_length} unless set: one line for the one value
    response = "actor_rollout_ref.rollout.response_length"
    if response in bad and bad[response] == bad.get("data.max_response_length", object()):
        del bad[response]
    return bad


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _top_k(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= -1


# Numbers that have a range: (key, test, what the value must be). Checked where set (null: unset).
_ROLLOUT, _ACTOR = "actor_rollout_ref.rollout", "actor_rollout_ref.actor"
_NORM = "> 0 (the largest gradient norm; a negative one would flip the step)"
RANGE_KEYS = (
    (f"{_ROLLOUT}.temperature", lambda v: v >= 0, ">= 0 (0: greedy)"),
    (f"{_ROLLOUT}.val_kwargs.temperature", lambda v: v >= 0, ">= 0 (0: greedy)"),
    (f"{_ROLLOUT}.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    (f"{_ROLLOUT}.val_kwargs.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    (f"{_ROLLOUT}.gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]: the KV share of free memory"),
    (f"{_ROLLOUT}.kv_cache_memory_gb", lambda v: v > 0, "null (gpu_memory_utilization sizes it) or > 0 GiB"),
    (f"{_ROLLOUT}.top_k", None, "-1 or 0 (off), or a positive integer"),
    (f"{_ROLLOUT}.val_kwargs.top_k", None, "-1 or 0 (off), or a positive integer"),
    (f"{_ACTOR}.clip_ratio", lambda v: v > 0, "> 0"),
    (f"{_ACTOR}.clip_ratio_low", lambda v: v > 0, "> 0"),
    (f"{_ACTOR}.clip_ratio_high", lambda v: v > 0, "> 0"),
    (f"{_ACTOR}.grad_clip", lambda v: v > 0, _NORM),
    ("critic.grad_clip", lambda v: v > 0, _NORM),
    (f"{_ACTOR}.optim.lr", lambda v: v >= 0, ">= 0"),
    ("critic.optim.lr", lambda v: v >= 0, ">= 0"),
    (f"{_ACTOR}.kl_loss_coef", lambda v: v >= 0, ">= 0"),
    ("algorithm.kl_ctrl.kl_coef", lambda v: v >= 0, ">= 0"),
    (f"{_ACTOR}.ppo_max_token_len_per_gpu", lambda v: v > 0, "> 0"),
    ("algorithm.gamma", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("algorithm.lam", lambda v: 0 <= v <= 1, "in [0, 1]"),
)


# String keys with a closed set of values (the ones whose other values would be read as one of these
# or fail inside a worker): key -> the values.
CHOICE_KEYS = {
    "data.truncation": ("error", "left", "right", "middle"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "actor_rollout_ref.rollout.dtype": ("fp32", "float32", "bf16", "bfloat16", "auto"),
}


def value_problems(config: DictConfig, schema: DictConfig) -> list[str]:
    """Values of the wrong kind (:func:`~.schema.type_mismatches`) or outside :data:`CHOICE_KEYS`."""
    from hybridflow.trainer.config.schema import type_mismatches

    sized = (*POSITIVE_KEYS, *POSITIVE_WHERE_SET_KEYS, *CRITIC_KEYS, *CRITIC_WHERE_SET_KEYS)
    checked = {key for key, _, _ in RANGE_KEYS}.union(sized, REWARD_MODEL_WHERE_SET_KEYS)  # named there
    mismatches = [m for m in type_mismatches(config, schema) if m[0] not in checked]
    problems = [f"{path}={_show(value)} must be {kind}" for path, value, kind in mismatches]
    for key, allowed in CHOICE_KEYS.items():
        value = OmegaConf.select(config, key, default=None)
        if value is not None and value not in allowed and value != "None":  # "None": rollout.dtype's null
            problems.append(f"{key}={_show(value)} must be one of {', '.join(allowed)}")
    return problems


def range_problems(config: DictConfig) -> list[str]:
    """One line per key of :data:`RANGE_KEYS` whose value is set and out of its range (or not a number)."""
    problems = []
    for key, test, must in RANGE_KEYS:
        value = OmegaConf.select(config, key, default=None)
        if value is None:
            continue
        ok = _top_k(value) if test is None else _number(value) and test(value)
        if not ok:
            problems.append(f"{key}={_show(value)} must be {must}")
    return problems


def size_problems(bad: dict[str, object]) -> list[str]:
    """One line per entry of :func:`bad_sizes`: the key, its value, and what it must be."""
    problems = []
    for key, value in bad.items():
        unset = "" if key in POSITIVE_KEYS or key in CRITIC_KEYS else " (or null: unset)"
        problems.append(f"{key}={_show(value)} must be a positive integer{unset}")
    return problems


def _show(value) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)
