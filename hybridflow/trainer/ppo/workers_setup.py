"""Which worker groups a PPO run needs, where they live, and how to start them.

Where: ``trainer.placement`` (:mod:`hybridflow.placement.spec`). By default all roles are colocated
(verl's default): one Ray actor process per device holds the hybrid actor/rollout/reference worker,
the critic and the reward model, so they share the device and the process group. With several
resource pools (verl's ``resource_pool_spec`` + ``mapping``), each pool gets its own processes holding
the roles mapped to it (``create_colocated_worker_cls`` per pool, as verl's ``init_workers``), its own
process group, and runs at the same time as the other pools. On CPU a "device" is one worker process
with ``trainer.num_threads_per_worker`` threads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig

from hybridflow.placement.spec import Placement, placement_from_config
from hybridflow.protocol import DataProto
from hybridflow.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    create_colocated_worker_cls,
    wait_futures,
)
from hybridflow.utils.ray_startup import LOCAL_RAY_SYSTEM_CONFIG


@dataclass
class WorkerGroups:
    """The role views of the worker processes (``None`` for roles not in use). ``ref`` answers
    ``compute_ref_log_prob``: the actor's own view when the reference shares its pool."""

    actor_rollout: RayWorkerGroup
    critic: RayWorkerGroup | None
    reward_model: RayWorkerGroup | None
    base: RayWorkerGroup  # the actor's pool
    flops_counter: object | None = None
    ppo_epochs: int = 1
    config: DictConfig | None = None  # builds flops_counter on first use (it needs the workers' device)
    ref: RayWorkerGroup | None = None
    pools: dict[str, RayWorkerGroup] | None = None  # pool name -> the group of its processes
    placement: Placement | None = None

    def __post_init__(self) -> None:
        if self.ref is None:  # one colocated group (verl's default): the actor's worker holds the reference
            self.ref = self.actor_rollout
        if self.pools is None:
            self.pools = {"global_pool": self.base} if self.base is not None else {}

    @property
    def world_size(self) -> int:
        """The actor's data-parallel ranks (what batches are balanced for)."""
        return self.actor_rollout.world_size

    @property
    def total_workers(self) -> int:
        """Worker processes (devices) of all pools."""
        return sum(group.world_size for group in self.pools.values()) or self.actor_rollout.world_size

    def init_models(self, total_training_steps: int | None = None) -> None:
        """Load every model. Critic, reward model and reference first, the actor last (verl's order:
        the actor is the largest resident set); pools load at the same time. ``total_training_steps``
        reaches the actor's and critic's lr schedules: the workers started before the trainer knew it."""
        order = (self.critic, self.reward_model, self.ref, self.actor_rollout)
        groups = [g for g in dict.fromkeys(order) if g is not None]
        trained = {id(g) for g in (self.critic, self.actor_rollout) if g is not None}
        wait_futures(
            [
                group.init_model_async(total_training_steps=total_training_steps)
                if id(group) in trained
                else group.init_model_async()
                for group in groups
            ]
        )

    def roles_on_node(self, node_id: str) -> list[str]:
        """``roles rank(s) r (pool p)`` for every pool with a worker on ``node_id``."""
        found = []
        for pool, group in self.pools.items():
            ranks = [r for r, node in enumerate(group.resource_pool.rank_node_ids) if node == node_id]
            if ranks:
                found.append(f"{self._roles(pool, group)} {_ranks(ranks)} (pool {pool})")
        return found

    def describe(self) -> list[str]:
        """One line per pool: its roles and the node of each rank (printed at start-up)."""
        lines = []
        for pool, group in self.pools.items():
            by_node: dict[str, list[int]] = {}
            for rank, node in enumerate(group.resource_pool.rank_node_ids):
                by_node.setdefault(node, []).append(rank)
            where = "; ".join(
                f"{_ranks(ranks)} on node {_node_name(node)}" for node, ranks in by_node.items()
            )
            lines.append(f"pool {pool} ({self._roles(pool, group)}): {where}")
        return lines

    def _roles(self, pool: str, group: RayWorkerGroup) -> str:
        if self.placement is not None:
            return "+".join(self.placement.roles_on(pool))
        return "+".join(group.ray_cls_with_init.cls.role_methods)

    def mfu_metrics(self, batch: DataProto, timing: dict, metrics: dict | None = None) -> dict[str, float]:
        """``perf/mfu/actor``: achieved training FLOP/s of the actor update over the peak of all workers.
        The FLOPs are the rows' (verl's count) less the share the update's shared-prompt layouts did not
        compute (``metrics["perf/shared_prompt_saved_frac"]``, from the workers): a GRPO group's prompt
        computed once counts once (counted per row, a tiny model's MFU read above 1)."""
        if self.flops_counter is None and self.config is not None:
            self.flops_counter = _flops_counter(self.config, self.base.device_names)
            self.config = None  # once, even when no peak is known
        if self.flops_counter is None or "update_actor" not in timing:
            return {}
        seqlens = batch.meta_info.get("global_token_num") or []
        achieved, peak = self.flops_counter.estimate(seqlens, timing["update_actor"])
        computed = 1.0 - float((metrics or {}).get("perf/shared_prompt_saved_frac", 0.0))
        return {"perf/mfu/actor": achieved * computed * self.ppo_epochs / (peak * self.world_size)}

    def shutdown(self) -> None:
        for group in self.pools.values():
            group.shutdown()


class NodeLostError(RuntimeError):
    """A node of the Ray cluster went away mid-run, taking worker processes with it."""


def node_lost_error(
    err: Exception, groups: WorkerGroups | None, latest_checkpoint: str | None
) -> NodeLostError | None:
    """The one-line error for a run that failed because a node left the cluster: ``err`` is the
    :class:`WorkerDiedError`, or an error raised while handling one (a failed checkpoint save).
    None when no node was lost."""
    died = err if isinstance(err, WorkerDiedError) else err.__context__
    if not isinstance(died, WorkerDiedError) or not died.node_lost or groups is None:
        return None
    roles = groups.roles_on_node(died.node.node_id) or ["none recorded"]
    during = "" if died is err else " during a checkpoint save (its partial files were removed)"
    kept = latest_checkpoint or "none: no checkpoint was saved yet"
    return NodeLostError(
        f"node {died.node.describe()} left the Ray cluster mid-run{during}; the roles on it: "
        f"{'; '.join(roles)}. The checkpoint a resume finds is {kept} (bring the node back, or place the "
        "roles elsewhere, and rerun the same command to resume)"
    )


def _node_name(node_id: str) -> str:
    from hybridflow.single_controller.ray.nodes import node_info

    info = node_info(node_id)
    return info.describe() if info is not None else node_id[:12]


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``ranks 0-2,5``; ``[3]`` -> ``rank 3``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    spans = ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {spans}"


_REAPER = None  # the process_reaper of the Ray instance ensure_ray started, if any


def ensure_ray(ray_init_cfg) -> bool:
    """Start (``address: local``) or join (``auto`` / an address) Ray unless this process already has;
    True when this call did (then :func:`shutdown_ray` ends it). Alongside it starts a reaper process
    (``hybridflow/utils/process_reaper.py``) that kills Ray's helper processes at once if this process
    dies without shutting Ray down (SIGKILL), instead of leaving them for a minute."""
    global _REAPER
    import ray

    if ray.is_initialized():
        return False
    # Ray's processes share this process group: a SIGTERM sent to the whole group (a scheduler
    # stopping a job) stops Ray's GCS too, and every Ray process then waits 60 s for it before giving
    # up. 15 s is still far beyond any pause of a healthy local GCS.
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "15")
    local = str(ray_init_cfg.address) == "local"
    ray.init(
        address=ray_init_cfg.address,
        # a running cluster has its own resources; Ray refuses num_cpus when joining one
        num_cpus=ray_init_cfg.num_cpus if local else None,
        include_dashboard=False if local else None,
        configure_logging=False,
        _system_config=dict(LOCAL_RAY_SYSTEM_CONFIG) if local else None,
    )
    from hybridflow.utils.process_reaper import Reaper

    _REAPER = Reaper().start()
    return True


def shutdown_ray() -> None:
    """``ray.shutdown()``, then have the reaper kill any helper that outlived it."""
    global _REAPER
    import ray

    ray.shutdown()
    if _REAPER is not None:
        _REAPER.close()
        _REAPER = None


def actor_role(use_reference: bool, hybrid: bool = True) -> str:
    """The actor worker's role: with the rollout engine in its process (``hybrid``, verl's hybrid
    engine) or without (the asynchronous trainer's pool), with or without the reference."""
    if hybrid:
        return "actor_rollout_ref" if use_reference else "actor_rollout"
    return "actor_ref" if use_reference else "actor"


def build_resource_pool(
    trainer_cfg: DictConfig, process_on_nodes: list[int] | None = None, name: str = "global_pool"
) -> RayResourcePool:
    """A pool of ``process_on_nodes`` workers (default: ``n_gpus_per_node`` on each of ``nnodes``)."""
    if process_on_nodes is None:
        process_on_nodes = [int(trainer_cfg.n_gpus_per_node)] * int(trainer_cfg.nnodes)
    return RayResourcePool(
        process_on_nodes=list(process_on_nodes),
        use_gpu=trainer_cfg.device == "cuda",
        max_colocate_count=1,
        cpus_per_process=1.0,
        name_prefix=name,
    )


def role_classes(
    config: DictConfig, placement: Placement, hybrid: bool = True
) -> dict[str, RayClassWithInitArgs]:
    """The worker class of each role in ``placement``. The reference rides in the actor's worker
    (``actor_rollout_ref``) when both share a pool, else it is a worker of its own (role ``ref``)."""
    from hybridflow.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

    roles = placement.mapping
    ref_with_actor = "ref" in roles and roles["ref"] == roles["actor_rollout"]
    classes = {
        "actor_rollout": RayClassWithInitArgs(
            ActorRolloutRefWorker, config.actor_rollout_ref, role=actor_role(ref_with_actor, hybrid)
        )
    }
    if "ref" in roles and not ref_with_actor:
        classes["ref"] = RayClassWithInitArgs(ActorRolloutRefWorker, config.actor_rollout_ref, role="ref")
    if "critic" in roles:
        classes["critic"] = RayClassWithInitArgs(
            CriticWorker, config.critic, rollout_n=int(config.actor_rollout_ref.rollout.n)
        )
    if "rm" in roles:
        from hybridflow.workers.reward_model_worker import RewardModelWorker

        classes["rm"] = RayClassWithInitArgs(RewardModelWorker, config.reward_model)
    return classes


def build_worker_groups(
    config: DictConfig, use_critic: bool, use_reference: bool, hybrid: bool = True
) -> WorkerGroups:
    """One worker group per resource pool, holding the roles placed on it; returns the role views.
    The processes start in the background (the groups do not wait for them). ``hybrid=False``: the
    actor's workers hold no rollout engine (the asynchronous trainer generates on a pool of its own)."""
    from hybridflow.trainer.ppo.step_profiler import nsight_runtime_env
    from hybridflow.utils.roles import reward_model_worker

    rm = reward_model_worker(config)
    placement = _with_roles(placement_from_config(config), use_critic, use_reference, rm)
    classes = role_classes(config, placement, hybrid)
    env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    pools, views = {}, {}
    for pool, counts in placement.pools.items():
        on_pool = {role: cls for role, cls in classes.items() if placement.mapping[role] == pool}
        pools[pool] = RayWorkerGroup(
            build_resource_pool(config.trainer, list(counts), pool),
            create_colocated_worker_cls(on_pool),
            name_prefix="hybridflow" if placement.is_colocated else f"hybridflow_{pool}",
            num_threads=int(config.trainer.num_threads_per_worker),
            env=env,
            # global_profiler.tool=nsys: a pool holding a profiled role runs under `nsys profile`
            runtime_env=nsight_runtime_env(config, [r for r, p in placement.mapping.items() if p == pool]),
        )
        views.update(pools[pool].spawn(on_pool.keys()))
    return WorkerGroups(
        actor_rollout=views["actor_rollout"],
        critic=views.get("critic"),
        reward_model=views.get("rm"),
        base=pools[placement.pool_of("actor_rollout")],
        config=config,
        ppo_epochs=int(config.actor_rollout_ref.actor.ppo_epochs),
        ref=views.get("ref"),
        pools=pools,
        placement=placement,
    )


def _with_roles(placement: Placement, critic: bool, ref: bool, rm: bool) -> Placement:
    """``placement`` for exactly these roles (a caller, e.g. a test, may want a role the config would
    not build): a role the placement lacks runs on the actor's pool; pools left empty are dropped."""
    roles = [r for r, used in (("actor_rollout", True), ("ref", ref), ("critic", critic), ("rm", rm)) if used]
    actor_pool = placement.pool_of("actor_rollout")
    mapping = {role: placement.mapping.get(role, actor_pool) for role in roles}
    return Placement({p: c for p, c in placement.pools.items() if p in mapping.values()}, mapping)


def _flops_counter(config: DictConfig, device_names: list[str]):
    """Counts actor FLOPs against the peak of one worker: ``trainer.peak_flops_per_worker``, else the
    known peak of the workers' device (``device_names``, as the workers report them: the driver needs
    no GPU) in the dtype the actor computes in (``mixed_precision`` as resolved for the device, else
    ``model_dtype``). An unknown GPU gives no MFU (and says so once) instead of stopping start-up."""
    import transformers

    from hybridflow.utils.flops_counter import FlopsCounter, default_peak_flops
    from hybridflow.workers.fsdp_utils import compute_dtype

    model = config.actor_rollout_ref.model
    model_config = transformers.AutoConfig.from_pretrained(
        os.path.expanduser(model.path), trust_remote_code=bool(model.get("trust_remote_code", False))
    )
    peak = config.trainer.get("peak_flops_per_worker")
    if not peak:
        device = str(config.trainer.device)
        dtype = compute_dtype(config.actor_rollout_ref.actor.fsdp_config, device)
        name = device_names[0] if device_names else None
        try:
            threads = int(config.trainer.num_threads_per_worker)
            peak = default_peak_flops(device, dtype, threads, device_name=name)
        except ValueError as err:
            print(f"perf/mfu/actor is not reported: {err} (set trainer.peak_flops_per_worker)")
            return None
    return FlopsCounter(model_config, float(peak))
