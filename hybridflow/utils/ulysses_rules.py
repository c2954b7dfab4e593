"""Ulysses sequence parallelism's rules and arithmetic, without torch: which sizes a model allows, where
verl's keys live, and how many bytes the all-to-alls move (DeepSpeed-Ulysses, Jacobs et al. 2023,
arXiv 2309.14509). Read by the config checks (:mod:`hybridflow.trainer.config.parallelism`), the
workers (:mod:`hybridflow.workers.ulysses`) and the placement planner (:mod:`hybridflow.placement`).
"""

from __future__ import annotations

SP_KEY = "ulysses_sequence_parallel_size"
# role -> (section holding verl's FSDP-worker key, its fsdp_config (the newer engine's key), model section)
SP_SECTIONS = {
    "actor_rollout": (
        "actor_rollout_ref.actor",
        "actor_rollout_ref.actor.fsdp_config",
        "actor_rollout_ref.model",
    ),
    "ref": ("actor_rollout_ref.ref", "actor_rollout_ref.ref.fsdp_config", "actor_rollout_ref.model"),
    "critic": ("critic", "critic.model.fsdp_config", "critic.model"),
    "rm": ("reward_model", "reward_model.model.fsdp_config", "reward_model.model"),
}


def head_split_problem(num_heads: int, num_kv_heads: int, sp: int) -> str | None:
    """Why ``sp`` cannot split the heads (None: it can). verl's rule for grouped key/value heads
    (``monkey_patch.py``): ``nkv % sp == 0`` splits them, ``sp % nkv == 0`` repeats each ``sp / nkv``
    times; anything else is refused."""
    if sp <= 1:
        return None
    if num_heads % sp:
        return f"num_attention_heads={num_heads} is not divisible by ulysses_sequence_parallel_size={sp}"
    if num_kv_heads % sp and sp % num_kv_heads:
        return (
            f"num_key_value_heads={num_kv_heads} and ulysses_sequence_parallel_size={sp}: one must divide "
            "the other (verl's rule: kv heads are split, or repeated sp / kv times)"
        )
    return None


def alltoall_bytes_per_layer(
    tokens: float, sp: int, num_heads: int, num_kv_heads: int, head_dim: int, element_bytes: int = 4
) -> float:
    """Bytes one rank sends to the other ranks of its SP group, per decoder layer and pass, for a
    sequence of ``tokens`` tokens (S): the rank holds L = S / sp tokens of q and the output (nh heads
    each) and of k and v (max(nkv, sp) heads each: kv heads repeated up to sp), and keeps 1 / sp of
    them::

        (sp - 1) / sp x S / sp x (2 nh + 2 max(nkv, sp)) x head_dim x element_bytes

    the paper's 4 N h / P per device with grouped kv heads. The backward sends as much again.
    ``benchmarks/sp_memory.py`` measured it to the byte (docs/placement_and_scaling.md)."""
    if sp <= 1:
        return 0.0
    heads = 2 * num_heads + 2 * max(num_kv_heads, sp)
    return (sp - 1) / sp * tokens / sp * heads * head_dim * element_bytes


def configured_sp_size(
    section, fsdp_config=None, names: tuple[str, str] = (SP_KEY, f"fsdp_config.{SP_KEY}")
) -> int:
    """A role's SP size from verl's two keys: ``<role>.ulysses_sequence_parallel_size`` (its FSDP worker)
    and ``<role>...fsdp_config.ulysses_sequence_parallel_size`` (its newer engine); ``names``: their full
    paths, for messages. Unset or null is 1; two values other than 1 must agree (ValueError)."""
    values = [part.get(SP_KEY) if part is not None else None for part in (section, fsdp_config)]
    values = [1 if value is None else value for value in values]
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    legacy, engine = values
    if legacy != 1 and engine != 1 and legacy != engine:
        raise ValueError(f"{names[0]}={legacy} and {names[1]}={engine} disagree: set one, or both the same")
    return max(legacy, engine)


def role_sp_size(config, role: str) -> int:
    """The SP size the run's config gives ``role`` (a key of :data:`SP_SECTIONS`), both keys read."""
    from omegaconf import OmegaConf

    section, fsdp_path, _ = SP_SECTIONS[role]
    names = (f"{section}.{SP_KEY}", f"{fsdp_path}.{SP_KEY}")
    return configured_sp_size(OmegaConf.select(config, section), OmegaConf.select(config, fsdp_path), names)
