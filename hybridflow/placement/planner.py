"""The auto-mapping planner (HybridFlow §6, Algorithm 1), on the cost model of :mod:`.cost_model`.

    for each placement (a partition of the roles into colocated sets, the actor and its rollout
                        always together):
        for each device allocation (workers per set; per node when the run spans nodes):
            skip it when a set's models do not fit its devices' memory or a batch does not split
            evenly over a set's workers
            cost = the predicted step time (generation, then each stage's longest pool)
    rank all by cost

The parallel size of every model is its set's worker count (FSDP data parallelism over the pool;
tensor and pipeline parallelism are not implemented, so there is nothing else to choose). Sets may
leave devices unused: on a small model more workers can cost more than they save.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from omegaconf import DictConfig

from hybridflow.placement.cost_model import CostModel, Workload, step_seconds
from hybridflow.placement.spec import Placement, batch_problems
from hybridflow.utils.roles import roles_in_use, update_computes_old_log_probs

# Resident bytes per parameter (fp32 master weights): the trained actor holds weights, gradients,
# two Adam moments and the rollout engine's copy; the critic the first four; frozen models weights only.
BYTES_PER_PARAM = {"actor_rollout": 20, "critic": 16, "ref": 4, "rm": 4}
MEMORY_HEADROOM = 0.9  # of a device's memory, for activations, the KV cache, allocator slack


@dataclass(frozen=True)
class Candidate:
    placement: Placement
    seconds: float
    stages: dict[str, float]


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


def fits_memory(placement: Placement, params: dict[str, float], device_memory_gb: float | None) -> bool:
    if not device_memory_gb:
        return True
    for pool, counts in placement.pools.items():
        needed = sum(BYTES_PER_PARAM[role] * params[role] for role in placement.roles_on(pool))
        if needed / sum(counts) > device_memory_gb * 2**30 * MEMORY_HEADROOM:
            return False
    return True


def rank_placements(
    config: DictConfig,
    model: CostModel,
    device_memory_gb: float | None = None,
    candidates: list[Placement] | None = None,
) -> list[Candidate]:
    """Feasible placements of the run ``config`` describes, fastest predicted first (ties: fewer
    workers). ``candidates`` restricts the search (default: :func:`enumerate_placements`)."""
    load = workload_from_config(config)
    trainer = config.trainer
    if candidates is None:
        candidates = enumerate_placements(
            roles_in_use(config), int(trainer.n_gpus_per_node), int(trainer.nnodes)
        )
    concurrent = bool(trainer.get("concurrent_phases", True))
    ranked = []
    for placement in candidates:
        if not fits_memory(placement, load.params, device_memory_gb) or batch_problems(config, placement):
            continue
        workers = {pool: sum(counts) for pool, counts in placement.pools.items()}
        seconds, stages = step_seconds(model, load, placement.mapping, workers, concurrent)
        ranked.append(Candidate(placement, seconds, stages))
    return sorted(ranked, key=lambda c: (c.seconds, c.placement.total_workers))


# ------------------------------------------------------------------------------------------ workload
def count_parameters(
    model_path: str, kind: str = "causal_lm", trust_remote_code: bool = False
) -> tuple[int, int]:
    """``(parameters, layers)`` of the model at ``model_path``, built on the meta device (no weights
    are read). ``kind``: ``causal_lm`` (actor, reference) or ``token_value`` (critic, reward model)."""
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
    return sum(p.numel() for p in model.parameters()), int(getattr(cfg, "num_hidden_layers", 1))


def workload_from_config(config: DictConfig) -> Workload:
    """The step's :class:`Workload`: model sizes of the roles in use, rows and lengths."""
    roles = roles_in_use(config)
    paths = {
        "actor_rollout": (config.actor_rollout_ref.model.path, "causal_lm"),
        "ref": (config.actor_rollout_ref.model.path, "causal_lm"),
        "critic": (config.critic.model.path, "token_value"),
        "rm": (config.reward_model.model.path, "token_value"),
    }
    params, layers, counted = {}, {}, {}
    for role in roles:
        key = paths[role]
        if key not in counted:
            counted[key] = count_parameters(str(key[0]), key[1])
        params[role], layers[role] = counted[key]
    return Workload(
        params=params,
        layers=layers,
        rows=int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n),
        prompt_length=int(config.data.max_prompt_length),
        response_length=int(config.data.max_response_length),
        reward_model=bool(config.reward_model.enable),
        old_log_prob=not update_computes_old_log_probs(config),
    )


# ------------------------------------------------------------------------------------------ profiles
def load_profile(path: str) -> tuple[CostModel, dict]:
    """The cost model calibrated from a profile JSON (written by :mod:`hybridflow.profile_placement`),
    and the JSON itself."""
    with open(os.path.expanduser(path)) as f:
        profile = json.load(f)
    samples = [{**s, "workload": Workload(**s["workload"])} for s in profile["samples"]]
    return CostModel.calibrate(samples), profile


def _best(config: DictConfig) -> tuple[Candidate, list[Candidate]]:
    model, profile = load_profile(str(config.trainer.placement_profile))
    ranked = rank_placements(config, model, profile.get("device_memory_gb"))
    if not ranked:
        raise ValueError(
            "trainer.placement=auto: no placement fits (memory, or batch sizes that split evenly over each "
            "pool's workers); set trainer.placement=pools by hand"
        )
    return ranked[0], ranked


def resolve_auto_placement(config: DictConfig) -> list[str]:
    """With ``trainer.placement=auto`` and no written choice: write the planner's choice into
    ``trainer.resource_pool_spec`` / ``role_pool_mapping`` and say what it chose (a start-up note)."""
    trainer = config.trainer
    if trainer.get("placement") != "auto" or trainer.get("resource_pool_spec"):
        return []
    best, ranked = _best(config)
    trainer.resource_pool_spec, trainer.role_pool_mapping = best.placement.config_values()
    runner_up = (
        f"; next: {ranked[1].placement.describe()} ({ranked[1].seconds:.2f} s)" if len(ranked) > 1 else ""
    )
    return [
        f"trainer.placement=auto: {best.placement.describe()} (predicted {best.seconds:.2f} s/step of "
        f"{len(ranked)} placements{runner_up})"
    ]


def format_ranking(ranked: list[Candidate], top: int | None = None) -> str:
    lines = [f"{'rank':>4}  {'s/step':>8}  {'workers':>7}  placement (stages: gen/prepare/adv/update s)"]
    for i, cand in enumerate(ranked[:top] if top else ranked, start=1):
        stages = "/".join(f"{cand.stages[s]:.2f}" for s in ("gen", "prepare", "adv", "update"))
        lines.append(
            f"{i:>4}  {cand.seconds:>8.3f}  {cand.placement.total_workers:>7}  "
            f"{cand.placement.describe()}  ({stages})"
        )
    return "\n".join(lines)
