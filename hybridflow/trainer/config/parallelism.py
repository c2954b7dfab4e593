"""Tensor-parallel layouts that cannot run are start-up errors (HybridFlow §5's 3D-HybridEngine).

Keys: ``actor_rollout_ref.actor.tensor_model_parallel_size`` (t, the actor's training TP; verl's FSDP
actor has no such key, its Megatron actor does), ``actor_rollout_ref.ref.tensor_model_parallel_size``
(defaults to t), ``critic.tensor_model_parallel_size`` and ``actor_rollout_ref.rollout
.tensor_model_parallel_size`` (t_g, verl's key: the generation TP). A layout is accepted when each size
divides its role's worker processes, t and t_g divide one another (generation groups are formed from
micro-DP groups of the training TP groups), and the model's heads, key-value heads, MLP width and
vocabulary divide by every size that splits them.
"""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig, OmegaConf

from hybridflow.models.moe import is_moe_config
from hybridflow.utils.ulysses_rules import SP_KEY
from hybridflow.utils.ulysses_rules import SP_SECTIONS as ROLE_SP_SECTIONS

TP_KEY = "tensor_model_parallel_size"
# (section holding the key, the fsdp_config path that names its role's pool, the model path key)
SECTIONS = (
    ("actor_rollout_ref.actor", "actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.model.path"),
    ("actor_rollout_ref.ref", "actor_rollout_ref.ref.fsdp_config", "actor_rollout_ref.model.path"),
    ("actor_rollout_ref.rollout", "actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.model.path"),
    ("critic", "critic.model.fsdp_config", "critic.model.path"),
)
MODEL_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def _size(config: DictConfig, section: str) -> int | str:
    value = OmegaConf.select(config, f"{section}.{TP_KEY}", default=1)
    return 1 if value is None else value


def _model_sizes(path: str) -> dict | None:
    """``config.json`` facts of a local model directory (None when there is none to read)."""
    file = os.path.join(os.path.expanduser(str(path)), "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as handle:
        raw = json.load(handle)
    sizes = {key: raw.get(key) for key in MODEL_SIZES}
    sizes["num_key_value_heads"] = sizes["num_key_value_heads"] or sizes["num_attention_heads"]
    return {"model_type": raw.get("model_type"), "moe": is_moe_config(raw), **sizes}


def _model_problems(key: str, size: int, facts: dict | None) -> list[str]:
    from hybridflow.workers.tensor_parallel import TP_MODEL_TYPES

    if facts is None or size == 1:
        return []
    if facts["model_type"] not in TP_MODEL_TYPES:
        # a mixture of experts: neither its experts nor its router have a tensor- or expert-parallel plan
        moe = " (a mixture-of-experts model; expert parallelism is not built either)" if facts["moe"] else ""
        return [
            f"{key}={size}: tensor parallelism supports {TP_MODEL_TYPES}, not {facts['model_type']!r}{moe}; "
            "set 1"
        ]
    return [
        f"{key}={size} does not divide the model's {name}={facts[name]}"
        for name in MODEL_SIZES
        if isinstance(facts[name], int) and facts[name] % size
    ]


def _in_use(config: DictConfig, section: str) -> bool:
    from hybridflow.utils.roles import need_critic

    return need_critic(config) if section == "critic" else True


def role_world_size(config: DictConfig, fsdp_path: str) -> int:
    """Worker processes of the pool the section's model runs on (``trainer.placement``)."""
    from hybridflow.placement.spec import placement_from_config, placement_problems

    everything = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    if config.trainer.get("placement", "colocated") == "colocated" or placement_problems(config):
        return everything
    if config.trainer.placement == "auto" and not config.trainer.resource_pool_spec:
        return everything
    role = next(r for prefix, r in _FSDP_ROLES if fsdp_path.startswith(prefix))
    placement = placement_from_config(config)
    return placement.world_size(role if role in placement.mapping else "actor_rollout")


_FSDP_ROLES = (
    ("actor_rollout_ref.ref", "ref"),
    ("actor_rollout_ref", "actor_rollout"),
    ("critic", "critic"),
    ("reward_model", "rm"),
)


def tensor_parallel_problems(config: DictConfig) -> list[str]:
    """One line per tensor-parallel setting that cannot run (empty: the layout is sound)."""
    problems: list[str] = []
    sizes: dict[str, int] = {}
    for section, fsdp_path, model_key in SECTIONS:
        key, size = f"{section}.{TP_KEY}", _size(config, section)
        if not _in_use(config, section):
            continue
        if not isinstance(size, int) or size < 1:
            problems.append(f"{key}={size!r} must be a positive integer")
            continue
        sizes[section] = size
        world = role_world_size(config, fsdp_path)
        if world % size:
            problems.append(f"{key}={size} does not divide the role's {world} worker processes")
        problems += _model_problems(key, size, _model_sizes(OmegaConf.select(config, model_key)))
    return problems + _combination_problems(config, sizes)


def _combination_problems(config: DictConfig, sizes: dict[str, int]) -> list[str]:
    actor, rollout = sizes.get("actor_rollout_ref.actor", 1), sizes.get("actor_rollout_ref.rollout", 1)
    problems = []
    if actor % rollout and rollout % actor:
        problems.append(
            f"actor_rollout_ref.actor.{TP_KEY}={actor} and rollout.{TP_KEY}={rollout}: one must divide the "
            "other (generation groups are cut from the training TP groups' micro-DP groups)"
        )
    if max(actor, rollout) > 1 and config.actor_rollout_ref.rollout.name not in ("engine", "vllm", "sglang"):
        problems.append(
            f"rollout.name={config.actor_rollout_ref.rollout.name}: tensor parallelism (actor or rollout "
            f"{TP_KEY} > 1) needs the embedded engine; set rollout.name=engine"
        )
    if rollout > 1 and config.actor_rollout_ref.rollout.multi_turn.enable:
        problems.append(
            f"rollout.{TP_KEY}={rollout} with multi_turn.enable: the ranks of a generation group must step "
            "their engines in lockstep, which tool calls of varying duration break; set 1"
        )
    lora = int(config.actor_rollout_ref.model.get("lora_rank", 0) or 0) > 0
    if lora and max(actor, sizes.get("actor_rollout_ref.ref", 1)) > 1:
        problems.append(f"model.lora_rank > 0 with actor/ref {TP_KEY} > 1 is not supported; set 1")
    return problems


# ----------------------------------------------------------------------------- Ulysses sequence parallelism
# (role section holding verl's FSDP-worker key, its fsdp_config (the newer engine's key), model section)
SP_SECTIONS = tuple(ROLE_SP_SECTIONS.values())


def _sp_in_use(config: DictConfig, section: str) -> bool:
    from hybridflow.utils.roles import need_critic, need_reference, reward_model_worker

    if section == "critic":
        return need_critic(config)
    if section == "reward_model":
        return reward_model_worker(config)
    if section == "actor_rollout_ref.ref":
        return need_reference(config)
    return True


def sequence_parallel_sizes(config: DictConfig) -> tuple[dict[str, int], list[str]]:
    """Each role's SP size (:func:`hybridflow.utils.ulysses_rules.configured_sp_size`) and the problems
    of reading them (a bad value, the two keys disagreeing)."""
    from hybridflow.utils.ulysses_rules import configured_sp_size

    sizes, problems = {}, []
    for section, fsdp_path, _ in SP_SECTIONS:
        names = (f"{section}.{SP_KEY}", f"{fsdp_path}.{SP_KEY}")
        try:
            sizes[section] = configured_sp_size(
                OmegaConf.select(config, section), OmegaConf.select(config, fsdp_path), names
            )
        except ValueError as error:
            problems.append(str(error))
    return sizes, problems


def sp_size(config: DictConfig, section: str) -> int:
    """The Ulysses SP size of role ``section`` (e.g. ``actor_rollout_ref.actor``) from either of verl's
    keys (the role's own, or its ``fsdp_config``'s): the one reading every feature's check uses. A bad
    value reads as 1 here; :func:`sequence_parallel_problems` reports it."""
    sizes, _ = sequence_parallel_sizes(config)
    value = sizes.get(section, 1)
    return value if isinstance(value, int) else 1


def device_type(config: DictConfig) -> str:
    """``trainer.device`` as every feature's check reads it (``cpu`` when unset)."""
    return str(OmegaConf.select(config, "trainer.device", default="cpu") or "cpu")


def tp_size(config: DictConfig, section: str) -> int:
    """The tensor-parallel size of role ``section`` (1 when unset or not an integer)."""
    value = _size(config, section)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def sequence_parallel_problems(config: DictConfig) -> list[str]:
    """One line per Ulysses setting that cannot run (empty: sound). Checked: the size divides the role's
    worker processes and the model's heads (verl's rule for kv heads), and is not combined with what
    splits heads or sequences otherwise (tensor parallelism, another attention implementation)."""
    from hybridflow.utils.ulysses_rules import head_split_problem

    sizes, problems = sequence_parallel_sizes(config)
    for section, fsdp_path, model_path in SP_SECTIONS:
        sp = sizes.get(section, 1)
        if sp == 1 or not _sp_in_use(config, section):
            continue
        key = f"{section}.{SP_KEY}={sp}"
        world = role_world_size(config, fsdp_path)
        if world % sp:
            problems.append(f"{key} does not divide the role's {world} worker processes")
        facts = _model_sizes(OmegaConf.select(config, f"{model_path}.path"))
        if facts is not None and facts["num_attention_heads"]:
            problem = head_split_problem(facts["num_attention_heads"], facts["num_key_value_heads"], sp)
            problems += [f"{key}: {problem}"] if problem else []
        if _is_vision_language(OmegaConf.select(config, f"{model_path}.path")):
            problems.append(f"{key}: a vision-language model's image inputs are not split; set 1")
        if int(OmegaConf.select(config, f"{section}.{TP_KEY}", default=1) or 1) > 1:
            problems.append(
                f"{key} with {section}.{TP_KEY} > 1: both split the attention heads of one model; use one"
            )
        override = OmegaConf.select(config, f"{model_path}.override_config.attn_implementation", default=None)
        if override not in (None, "hybridflow_cpu"):
            problems.append(
                f"{key} with {model_path}.override_config.attn_implementation={override}: sequence "
                "parallelism runs in hybridflow's packed attention; remove the override"
            )
    return problems + _sp_combination_problems(config, sizes)


def _is_vision_language(path) -> bool:
    file = os.path.join(os.path.expanduser(str(path)), "config.json")
    if not path or not os.path.isfile(file):
        return False
    with open(file) as handle:
        return "vision_config" in json.load(handle)


def _sp_combination_problems(config: DictConfig, sizes: dict[str, int]) -> list[str]:
    from hybridflow.utils.roles import need_reference

    actor, ref = sizes.get("actor_rollout_ref.actor", 1), sizes.get("actor_rollout_ref.ref", 1)
    lora = int(config.actor_rollout_ref.model.get("lora_rank", 0) or 0) > 0
    if lora and need_reference(config) and actor != ref:
        return [
            f"model.lora_rank > 0: the reference is the actor's own module (adapter off), so "
            f"actor_rollout_ref.ref.{SP_KEY}={ref} must equal the actor's {actor}"
        ]
    return []
