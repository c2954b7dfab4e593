"""Which worker groups a PPO run needs, where they live, and how to start them.

All roles are colocated (verl's default): one Ray actor process per device holds the hybrid
actor/rollout/reference worker, the critic and the reward model, so they share the device and the
process group. On CPU a "device" is one worker process with ``trainer.num_threads_per_worker``
threads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig

from hybridflow.protocol import DataProto
from hybridflow.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)


@dataclass
class WorkerGroups:
    """The role views of the colocated worker processes (``None`` for roles not in use)."""

    actor_rollout: RayWorkerGroup
    critic: RayWorkerGroup | None
    reward_model: RayWorkerGroup | None
    base: RayWorkerGroup
    flops_counter: object | None = None
    ppo_epochs: int = 1

    @property
    def world_size(self) -> int:
        return self.base.world_size

    def init_models(self) -> None:
        # Critic and reward model first (verl's order): the actor is the largest resident set.
        for group in (self.critic, self.reward_model, self.actor_rollout):
            if group is not None:
                group.init_model()

    def mfu_metrics(self, batch: DataProto, timing: dict) -> dict[str, float]:
        """``perf/mfu/actor``: achieved training FLOP/s of the actor update over the peak of all workers."""
        if self.flops_counter is None or "update_actor" not in timing:
            return {}
        seqlens = batch.meta_info.get("global_token_num") or []
        achieved, peak = self.flops_counter.estimate(seqlens, timing["update_actor"])
        return {"perf/mfu/actor": achieved * self.ppo_epochs / (peak * self.world_size)}

    def shutdown(self) -> None:
        self.base.shutdown()


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
    ray.init(
        address=ray_init_cfg.address,
        num_cpus=ray_init_cfg.num_cpus,
        include_dashboard=False,
        configure_logging=False,
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


def actor_role(use_reference: bool) -> str:
    return "actor_rollout_ref" if use_reference else "actor_rollout"


def build_resource_pool(trainer_cfg: DictConfig) -> RayResourcePool:
    use_gpu = trainer_cfg.device == "cuda"
    return RayResourcePool(
        process_on_nodes=[int(trainer_cfg.n_gpus_per_node)] * int(trainer_cfg.nnodes),
        use_gpu=use_gpu,
        max_colocate_count=1,
        cpus_per_process=1.0,
        name_prefix="global_pool",
    )


def build_worker_groups(config: DictConfig, use_critic: bool, use_reference: bool) -> WorkerGroups:
    from hybridflow.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

    class_dict = {
        "actor_rollout": RayClassWithInitArgs(
            ActorRolloutRefWorker, config.actor_rollout_ref, role=actor_role(use_reference)
        )
    }
    if use_critic:
        class_dict["critic"] = RayClassWithInitArgs(
            CriticWorker, config.critic, rollout_n=int(config.actor_rollout_ref.rollout.n)
        )
    if config.reward_model.enable:
        from hybridflow.workers.reward_model_worker import RewardModelWorker

        class_dict["rm"] = RayClassWithInitArgs(RewardModelWorker, config.reward_model)
    env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    base = RayWorkerGroup(
        build_resource_pool(config.trainer),
        create_colocated_worker_cls(class_dict),
        name_prefix="hybridflow",
        num_threads=int(config.trainer.num_threads_per_worker),
        env=env,
    )
    groups = base.spawn(class_dict.keys())
    return WorkerGroups(
        actor_rollout=groups["actor_rollout"],
        critic=groups.get("critic"),
        reward_model=groups.get("rm"),
        base=base,
        flops_counter=_flops_counter(config, base.device_names),
        ppo_epochs=int(config.actor_rollout_ref.actor.ppo_epochs),
    )


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
