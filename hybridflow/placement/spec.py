"""A placement: named resource pools and the pool each role of the dataflow runs on (verl's
``resource_pool_spec`` and ``mapping``), read from the ``trainer`` config section:

- ``placement: colocated`` (default, verl's): one pool ``global_pool`` of ``n_gpus_per_node`` workers on
  each of ``nnodes`` nodes, every role in each worker process;
- ``placement: pools``: ``resource_pool_spec`` (``{pool: [workers on node 0, node 1, ...]}``) and
  ``role_pool_mapping`` (``{role: pool}``; a role left out runs on the actor's pool);
- ``placement: auto``: the planner's choice (:mod:`hybridflow.placement.planner`), calibrated by
  ``placement_profile``; the driver writes it into ``resource_pool_spec`` / ``role_pool_mapping``.

Roles: ``actor_rollout`` (the hybrid actor + rollout engine: they share weights, so they are never
split), ``ref`` (reference policy), ``critic``, ``rm`` (reward model). Roles on one pool share its
worker processes (one process per device holds all of them); roles on different pools run at the
same time. Pure Python: importable without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig

from hybridflow.utils.roles import ROLES, roles_in_use

PLACEMENT_MODES = ("colocated", "pools", "auto")
COLOCATED_POOL = "global_pool"


@dataclass(frozen=True)
class Placement:
    """``pools``: pool name -> worker processes per node; ``mapping``: each role in use -> its pool."""

    pools: dict[str, tuple[int, ...]]
    mapping: dict[str, str]

    def pool_of(self, role: str) -> str:
        return self.mapping[role]

    def world_size(self, role: str) -> int:
        return sum(self.pools[self.mapping[role]])

    def roles_on(self, pool: str) -> list[str]:
        return [role for role in ROLES if self.mapping.get(role) == pool]

    @property
    def total_workers(self) -> int:
        return sum(sum(counts) for counts in self.pools.values())

    @property
    def shape(self) -> tuple:
        """The placement without its pool names: which roles share a pool, and its workers per node."""
        return tuple(sorted((tuple(self.roles_on(pool)), counts) for pool, counts in self.pools.items()))

    @property
    def is_colocated(self) -> bool:
        return len(self.pools) == 1

    def describe(self) -> str:
        """E.g. ``actor_rollout on actor [1]; ref+critic on aux [1]``."""
        return "; ".join(
            f"{'+'.join(self.roles_on(pool))} on {pool} {list(counts)}" for pool, counts in self.pools.items()
        )

    def config_values(self) -> tuple[dict, dict]:
        """``(resource_pool_spec, role_pool_mapping)`` as config values."""
        return {pool: list(counts) for pool, counts in self.pools.items()}, dict(self.mapping)


def colocated_placement(workers_per_node: list[int], roles: list[str]) -> Placement:
    return Placement({COLOCATED_POOL: tuple(workers_per_node)}, {role: COLOCATED_POOL for role in roles})


def placement_from_config(config: DictConfig) -> Placement:
    """The run's placement as the config writes it. Assumes :func:`placement_problems` found nothing;
    ``auto`` needs the planner's choice written first
    (:func:`hybridflow.placement.planner.resolve_auto_placement`, done by ``run_ppo``)."""
    trainer = config.trainer
    roles = roles_in_use(config)
    mode = trainer.get("placement", "colocated")
    spec = trainer.get("resource_pool_spec") or {}
    if mode == "colocated":
        return colocated_placement([int(trainer.n_gpus_per_node)] * int(trainer.nnodes), roles)
    if mode == "auto" and not spec:
        raise ValueError(
            "trainer.placement=auto: the planner's choice is not written yet; "
            "hybridflow.placement.planner.resolve_auto_placement(config) writes it"
        )
    pools = {str(name): tuple(int(n) for n in counts) for name, counts in spec.items()}
    mapping = {str(role): str(pool) for role, pool in (trainer.get("role_pool_mapping") or {}).items()}
    actor_pool = mapping.get("actor_rollout", next(iter(pools)))
    return Placement(pools, {role: mapping.get(role, actor_pool) for role in roles})


# ------------------------------------------------------------------------------------------ validation
def placement_problems(config: DictConfig) -> list[str]:
    """Why the ``trainer.placement*`` keys cannot be used (one line each; empty: fine)."""
    trainer = config.trainer
    mode = trainer.get("placement", "colocated")
    spec = trainer.get("resource_pool_spec") or {}
    mapping = trainer.get("role_pool_mapping") or {}
    problems = []
    if not isinstance(trainer.get("concurrent_phases", True), bool):
        problems.append(f"trainer.concurrent_phases={trainer.concurrent_phases!r}: use true or false")
    if mode not in PLACEMENT_MODES:
        return problems + [f"trainer.placement={mode!r}: use one of {', '.join(PLACEMENT_MODES)}"]
    profile = trainer.get("placement_profile")
    if mode != "auto" and profile:
        problems.append("trainer.placement_profile is only read with trainer.placement=auto; remove it")
    if mode == "colocated":
        if spec or mapping:
            problems.append(
                "trainer.resource_pool_spec / role_pool_mapping are only read with trainer.placement=pools "
                "(or written by placement=auto); set trainer.placement=pools or remove them"
            )
        return problems
    if mode == "auto":
        import os

        if not profile or not os.path.isfile(os.path.expanduser(str(profile))):
            problems.append(
                f"trainer.placement=auto needs trainer.placement_profile, the JSON of a profiling run "
                f"(python -m hybridflow.profile_placement); {profile!r} is not a file"
            )
        if mapping and not spec:
            problems.append("trainer.placement=auto chooses role_pool_mapping itself; remove it")
        if not spec:
            return problems
    return problems + _pool_problems(config, spec, mapping)


def _pool_problems(config: DictConfig, spec, mapping) -> list[str]:
    trainer = config.trainer
    nnodes, per_node = int(trainer.nnodes), int(trainer.n_gpus_per_node)
    if not spec:
        return ["trainer.placement=pools needs trainer.resource_pool_spec, e.g. {actor: [1], aux: [1]}"]
    problems = []
    for pool, counts in spec.items():
        ok = isinstance(counts, list | ListConfig) and counts and all(_positive_int(n) for n in counts)
        if not ok:
            problems.append(
                f"trainer.resource_pool_spec.{pool}={counts!r}: use a list of worker processes per node, "
                "each a positive integer"
            )
        elif len(counts) > nnodes:
            problems.append(
                f"trainer.resource_pool_spec.{pool} lists {len(counts)} nodes but trainer.nnodes={nnodes}"
            )
    if problems:
        return problems
    for node in range(nnodes):
        used = sum(int(counts[node]) for counts in spec.values() if node < len(counts))
        if used > per_node:
            problems.append(
                f"trainer.resource_pool_spec puts {used} worker processes on node {node} but "
                f"trainer.n_gpus_per_node={per_node} (the devices per node the pools share)"
            )
    return problems + _mapping_problems(config, spec, mapping)


def _mapping_problems(config: DictConfig, spec, mapping) -> list[str]:
    problems = []
    roles = roles_in_use(config)
    for role, pool in mapping.items():
        if role not in ROLES:
            problems.append(f"trainer.role_pool_mapping.{role}: unknown role; roles: {', '.join(ROLES)}")
        elif role not in roles:
            problems.append(
                f"trainer.role_pool_mapping.{role}: this run has no {role} (roles in use: "
                f"{', '.join(roles)}); remove it"
            )
        elif pool not in spec:
            problems.append(
                f"trainer.role_pool_mapping.{role}={pool!r} is not a pool of trainer.resource_pool_spec "
                f"({', '.join(map(str, spec))})"
            )
    if len(spec) > 1 and "actor_rollout" not in mapping:
        problems.append("trainer.role_pool_mapping.actor_rollout: say which pool the actor runs on")
    if problems:
        return problems
    placement = placement_from_config(config)
    for pool in spec:
        if not placement.roles_on(str(pool)):
            problems.append(f"trainer.resource_pool_spec.{pool}: no role runs on this pool; remove it")
    return problems


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def batch_problems(config: DictConfig, placement: Placement) -> list[str]:
    """Batch sizes that do not split evenly over the worker processes of each role's pool."""
    problems: list[str] = []
    n = int(config.actor_rollout_ref.rollout.n)
    train_bsz = int(config.data.train_batch_size)
    actor = config.actor_rollout_ref.actor

    def workers_of(role: str) -> tuple[int, str]:
        pool = placement.pool_of(role)
        label = "worker processes" if placement.is_colocated else f"pool {pool!r} worker processes"
        return placement.world_size(role), label

    for pool in placement.pools:  # every pool a batch is dispatched to
        if placement.roles_on(pool):
            first_role = placement.roles_on(pool)[0]
            _divides(problems, "data.train_batch_size x rollout.n", train_bsz * n, *workers_of(first_role))
    mini = int(actor.ppo_mini_batch_size)
    _divides(problems, "data.train_batch_size", train_bsz, mini, "actor.ppo_mini_batch_size")
    sections = [("actor_rollout_ref.actor", actor, "actor_rollout")]
    if "critic" in placement.mapping:
        sections.append(("critic", config.critic, "critic"))
    for name, section, role in sections:
        workers, label = workers_of(role)
        responses = int(section.ppo_mini_batch_size) * n
        _divides(problems, f"{name}.ppo_mini_batch_size x rollout.n", responses, workers, label)
        micro = section.get("ppo_micro_batch_size_per_gpu")
        if not section.use_dynamic_bsz and micro and responses % workers == 0:
            _divides(
                problems,
                f"{name} mini-batch per worker",
                responses // workers,
                int(micro),
                f"{name}.ppo_micro_batch_size_per_gpu",
            )
    return problems


def _divides(problems: list[str], what: str, value: int, by: int, by_what: str) -> None:
    if by <= 0 or value % by:
        problems.append(f"{what}={value} is not divisible by {by_what}={by}")
