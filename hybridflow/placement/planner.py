"""The auto-mapping planner (HybridFlow §6, Algorithm 1), on the cost model of :mod:`.cost_model`.

    for each placement (a partition of the roles into colocated sets, the actor and its rollout
                        always together):
        for each device allocation (workers per set; per node when the run spans nodes):
            skip it when a batch does not split evenly over a set's workers
            each model's Ulysses SP size: the smallest the rules allow that fits its activations
            skip it when a set's models do not fit its devices' memory at any allowed SP size
            cost = the predicted step time (generation, then each stage's longest pool)
    rank all by cost

The parallel size of every model is its set's worker count (FSDP data parallelism over the pool;
tensor and pipeline parallelism are not in the search). Sets may leave devices unused: on a small model
more workers can cost more than they save. Sequence parallelism trades memory for time: sp > 1 cuts a
rank's activations (:mod:`.memory`) and adds the attention all-to-alls (:mod:`.cost_model`), so the
planner raises it only as far as the device memory needs (with no memory limit, never), and keeps an
sp > 1 the config sets (a size left at 1, the default, is the planner's to raise).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from hybridflow.placement.cost_model import CostModel, Workload, step_seconds
from hybridflow.placement.memory import activation_bytes, choose_sequence_parallel, usable_bytes
from hybridflow.placement.spec import Placement, batch_problems
from hybridflow.utils.roles import reward_model_worker, roles_in_use, update_computes_old_log_probs
from hybridflow.utils.ulysses_rules import SP_KEY, SP_SECTIONS, head_split_problem, role_sp_size


@dataclass(frozen=True)
class Candidate:
    placement: Placement
    seconds: float
    stages: dict[str, float]
    sp: dict[str, int] = field(default_factory=dict)  # role -> Ulysses SP size
    peak_bytes: dict[str, float] = field(default_factory=dict)  # pool -> predicted peak per worker


def set_partitions(items: list[str]) -> list[list[list[str]]]:
    """Every partition of ``items`` into non-empty sets (order within and between sets as in ``items``)."""
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for partition in set_partitions(rest):
        out.append([[first], *partition])
        for i in range(len(partition)):
            out.append([*partition[:i], [first, *partition[i]], *partition[i + 1 :]])
    return out


def allocations(sets: int, devices: int) -> list[tuple[int, ...]]:
    """Workers per set, each >= 1, summing to at most ``devices``."""
    if sets == 0:
        return [()]
    return [(d, *rest) for d in range(1, devices + 1) for rest in allocations(sets - 1, devices - d)]


def enumerate_placements(roles: list[str], devices_per_node: int, nnodes: int = 1) -> list[Placement]:
    """Every placement of ``roles`` on ``nnodes`` nodes of ``devices_per_node`` devices: each pool has
    the same number of workers on every node."""
    found = []
    for partition in set_partitions(list(roles)):
        partition.sort(key=lambda group: "actor_rollout" not in group)  # the actor's pool first
        for alloc in allocations(len(partition), devices_per_node):
            pools = {
                "_".join(group): (count,) * nnodes for group, count in zip(partition, alloc, strict=True)
            }
            mapping = {role: "_".join(group) for group in partition for role in group}
            found.append(Placement(pools, mapping))
    return found


def sp_options(config: DictConfig, load: Workload, placement: Placement, role: str) -> list[int]:
    """The Ulysses SP sizes ``role`` may take on its pool, ascending: an sp > 1 the config sets (if it
    divides the pool's workers), else every size that divides them and the model's heads (verl's kv
    rule), or only 1 where SP cannot run (the same refusals as the config checks)."""
    workers, shape = placement.world_size(role), load.shapes.get(role)
    configured = role_sp_size(config, role)
    if configured > 1:
        return [configured] if workers % configured == 0 else []
    if shape is None or _sp_blocked(config, role, shape):
        return [1]
    return [
        sp
        for sp in range(1, workers + 1)
        if workers % sp == 0 and head_split_problem(shape["heads"], shape["kv_heads"], sp) is None
    ]


def _sp_blocked(config: DictConfig, role: str, shape: dict) -> bool:
    """SP cannot run for the role: tensor parallelism splits its heads, a vision-language model's
    images are not split, or another attention implementation is asked for
    (:func:`hybridflow.trainer.config.parallelism.sequence_parallel_problems` refuses the same)."""
    section, _, model = SP_SECTIONS[role]
    tp = int(OmegaConf.select(config, f"{section}.tensor_model_parallel_size", default=1) or 1)
    attention = OmegaConf.select(config, f"{model}.override_config.attn_implementation", default=None)
    return tp > 1 or bool(shape.get("vision")) or attention not in (None, "hybridflow_cpu")


def _tied_roles(config: DictConfig, placement: Placement) -> dict[str, str]:
    """LoRA: the reference is the actor's own module (adapter off), so its sp is the actor's."""
    lora = int(config.actor_rollout_ref.model.get("lora_rank", 0) or 0) > 0
    return {"ref": "actor_rollout"} if lora and "ref" in placement.mapping else {}


def rank_placements(
    config: DictConfig,
    model: CostModel,
    device_memory_gb: float | None = None,
    candidates: list[Placement] | None = None,
) -> list[Candidate]:
    """Feasible placements of the run ``config`` describes, each with its roles' SP sizes, fastest
    predicted first (ties: fewer workers). ``candidates`` restricts the search (default:
    :func:`enumerate_placements`)."""
    load = workload_from_config(config)
    trainer = config.trainer
    if candidates is None:
        candidates = enumerate_placements(
            roles_in_use(config), int(trainer.n_gpus_per_node), int(trainer.nnodes)
        )
    concurrent = bool(trainer.get("concurrent_phases", True))
    ranked = []
    for placement in candidates:
        if batch_problems(config, placement):
            continue
        options = {role: sp_options(config, load, placement, role) for role in placement.mapping}
        tied = _tied_roles(config, placement)
        choice = choose_sequence_parallel(placement, load, options, device_memory_gb, tied)
        if choice is None:
            continue
        sp, peaks = choice
        workers = {pool: sum(counts) for pool, counts in placement.pools.items()}
        seconds, stages = step_seconds(model, load, placement.mapping, workers, concurrent, sp)
        ranked.append(Candidate(placement, seconds, stages, sp, peaks))
    return sorted(ranked, key=lambda c: (c.seconds, c.placement.total_workers))


# ------------------------------------------------------------------------------------------ workload
def count_parameters(
    model_path: str, kind: str = "causal_lm", trust_remote_code: bool = False
) -> tuple[int, int, dict[str, int]]:
    """``(parameters, layers, shape)`` of the model at ``model_path``, built on the meta device (no
    weights are read); ``shape``: its text model's ``hidden``, ``heads``, ``kv_heads``, ``head_dim``,
    ``vocab`` and ``vision`` (1 for a vision-language model). ``kind``: ``causal_lm`` (actor,
    reference) or ``token_value`` (critic, reward model)."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(
        os.path.expanduser(model_path), trust_remote_code=trust_remote_code
    )
    if kind == "token_value":
        cfg.num_labels = 1
        auto = transformers.AutoModelForTokenClassification
    else:
        auto = transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg, trust_remote_code=trust_remote_code)
    text = cfg.get_text_config()
    heads = int(text.num_attention_heads)
    shape = {
        "hidden": int(text.hidden_size),
        "heads": heads,
        "kv_heads": int(getattr(text, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        "vocab": int(text.vocab_size),
        "vision": int(hasattr(cfg, "vision_config")),
    }
    layers = int(getattr(text, "num_hidden_layers", 1))
    return sum(p.numel() for p in model.parameters()), layers, shape


# role -> (its section, micro-batch size key, dynamic-batch-size key, token budget key, the rows its
# pass splits over the data-parallel ranks: "mini" an update's mini-batch, "all" a forward's batch)
_MICRO_KEYS = {
    "actor_rollout": (
        "actor_rollout_ref.actor",
        "ppo_micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "ppo_max_token_len_per_gpu",
        "mini",
    ),
    "ref": (
        "actor_rollout_ref.ref",
        "log_prob_micro_batch_size_per_gpu",
        "log_prob_use_dynamic_bsz",
        "log_prob_max_token_len_per_gpu",
        "all",
    ),
    "critic": (
        "critic",
        "ppo_micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "ppo_max_token_len_per_gpu",
        "mini",
    ),
    "rm": (
        "reward_model",
        "micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "forward_max_token_len_per_gpu",
        "all",
    ),
}
_CHECKPOINTING_KEYS = {
    "actor_rollout": "actor_rollout_ref.model.enable_gradient_checkpointing",
    "critic": "critic.model.enable_gradient_checkpointing",
}


def _micro_batch(config: DictConfig, role: str, rows: int) -> tuple[int | None, int, int]:
    """``(micro_rows, token_budget, batch_rows)`` of the role's heaviest pass (see :class:`Workload`)."""
    section, micro_key, dynamic_key, budget_key, split = _MICRO_KEYS[role]
    mini = OmegaConf.select(config, f"{section}.ppo_mini_batch_size", default=None)
    batch_rows = int(mini) * int(config.actor_rollout_ref.rollout.n) if split == "mini" and mini else rows
    budget = int(OmegaConf.select(config, f"{section}.{budget_key}", default=0) or 0)
    if OmegaConf.select(config, f"{section}.{dynamic_key}", default=False):
        return 0, budget, batch_rows
    micro = OmegaConf.select(config, f"{section}.{micro_key}", default=None)
    return (int(micro) if micro else None), budget, batch_rows


def workload_from_config(config: DictConfig) -> Workload:
    """The step's :class:`Workload`: model sizes and shapes of the roles in use, rows, lengths, and
    each role's micro-batch (what its activation memory scales with)."""
    roles = roles_in_use(config)
    paths = {
        "actor_rollout": (config.actor_rollout_ref.model.path, "causal_lm"),
        "ref": (config.actor_rollout_ref.model.path, "causal_lm"),
        "critic": (config.critic.model.path, "token_value"),
        "rm": (config.reward_model.model.path, "token_value"),
    }
    rows = int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
    params, layers, shapes, counted = {}, {}, {}, {}
    micro_rows, token_budget, batch_rows = {}, {}, {}
    for role in roles:
        key = paths[role]
        if key not in counted:
            counted[key] = count_parameters(str(key[0]), key[1])
        params[role], layers[role], shapes[role] = counted[key]
        micro_rows[role], token_budget[role], batch_rows[role] = _micro_batch(config, role, rows)
    checkpointing = {
        role: bool(OmegaConf.select(config, key, default=False))
        for role, key in _CHECKPOINTING_KEYS.items()
        if role in roles
    }
    return Workload(
        params=params,
        layers=layers,
        rows=rows,
        prompt_length=int(config.data.max_prompt_length),
        response_length=int(config.data.max_response_length),
        reward_model=reward_model_worker(config),
        old_log_prob=not update_computes_old_log_probs(config),
        shapes=shapes,
        micro_rows=micro_rows,
        token_budget=token_budget,
        batch_rows=batch_rows,
        checkpointing=checkpointing,
    )


# ------------------------------------------------------------------------------------------ profiles
def load_profile(path: str) -> tuple[CostModel, dict]:
    """The cost model calibrated from a profile JSON (written by :mod:`hybridflow.profile_placement`),
    and the JSON itself."""
    with open(os.path.expanduser(path)) as f:
        profile = json.load(f)
    samples = [{**s, "workload": Workload(**s["workload"])} for s in profile["samples"]]
    model = CostModel.calibrate(samples)
    if profile.get("link_gb_per_s") is not None:
        if not float(profile["link_gb_per_s"]) > 0:
            raise ValueError(f"{path}: link_gb_per_s={profile['link_gb_per_s']!r} must be positive")
        model.link_gb_per_s = float(profile["link_gb_per_s"])
    return model, profile


def _best(config: DictConfig) -> tuple[Candidate, list[Candidate], float | None]:
    model, profile = load_profile(str(config.trainer.placement_profile))
    memory = profile.get("device_memory_gb")
    ranked = rank_placements(config, model, memory)
    if not ranked:
        raise ValueError(
            "trainer.placement=auto: no placement fits (memory at every allowed "
            "ulysses_sequence_parallel_size, or batch sizes that split evenly over each pool's workers); "
            "set trainer.placement=pools by hand"
        )
    return ranked[0], ranked, memory


def sequence_parallel_note(config: DictConfig, best: Candidate, device_memory_gb: float | None) -> str:
    """Which roles run with sp > 1 and why: the config set it, or the predicted memory per worker at
    sp = 1 does not fit the device (empty when every role runs at sp = 1)."""
    load, parts = workload_from_config(config), []
    for role, sp in best.sp.items():
        if sp == 1:
            continue
        if role_sp_size(config, role) == sp or not device_memory_gb:
            parts.append(f"{role} sp={sp} (set in the config)")
            continue
        pool = best.placement.pool_of(role)
        workers = best.placement.world_size(role)
        base = best.peak_bytes[pool] - activation_bytes(load, role, sp, workers)
        at_one = base + activation_bytes(load, role, 1, workers)
        parts.append(
            f"{role} sp={sp} (predicted {best.peak_bytes[pool] / 2**30:.2f} GiB per worker of "
            f"{usable_bytes(device_memory_gb) / 2**30:.2f} usable; sp=1 would need {at_one / 2**30:.2f} GiB)"
        )
    return f"; Ulysses SP: {', '.join(parts)}" if parts else ""


def resolve_auto_placement(config: DictConfig) -> list[str]:
    """With ``trainer.placement=auto`` and no written choice: write the planner's choice into
    ``trainer.resource_pool_spec`` / ``role_pool_mapping`` and say what it chose (a start-up note)."""
    trainer = config.trainer
    if trainer.get("placement") != "auto" or trainer.get("resource_pool_spec"):
        return []
    best, ranked, memory = _best(config)
    trainer.resource_pool_spec, trainer.role_pool_mapping = best.placement.config_values()
    sp_note = sequence_parallel_note(config, best, memory)  # before the keys below are written
    for role, sp in best.sp.items():  # verl's FSDP-worker key of each role the planner raised
        if sp != role_sp_size(config, role):
            OmegaConf.update(config, f"{SP_SECTIONS[role][0]}.{SP_KEY}", sp)
    runner_up = (
        f"; next: {ranked[1].placement.describe()} ({ranked[1].seconds:.2f} s)" if len(ranked) > 1 else ""
    )
    return [
        f"trainer.placement=auto: {best.placement.describe()} (predicted {best.seconds:.2f} s/step of "
        f"{len(ranked)} placements{runner_up}){sp_note}"
    ]


def format_ranking(ranked: list[Candidate], top: int | None = None) -> str:
    header = "placement (stages: gen/prepare/adv/update s)  Ulysses SP per role"
    lines = [f"{'rank':>4}  {'s/step':>8}  {'workers':>7}  {header}"]
    for i, cand in enumerate(ranked[:top] if top else ranked, start=1):
        stages = "/".join(f"{cand.stages[s]:.2f}" for s in ("gen", "prepare", "adv", "update"))
        sp = " ".join(f"{role}={size}" for role, size in cand.sp.items())
        lines.append(
            f"{i:>4}  {cand.seconds:>8.3f}  {cand.placement.total_workers:>7}  "
            f"{cand.placement.describe()}  ({stages})  sp: {sp}"
        )
    return "\n".join(lines)
