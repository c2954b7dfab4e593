"""Parameter sync between pools: the trainer's actor weights to the rollouter's replicas, through verl's
checkpoint engine (:mod:`hybridflow.workers.checkpoint_engine`).

By default (``async_training.checkpoint_engine.enable=true``, ``backend`` null) the weights stream as
buckets broadcast by a torch.distributed group built between the actor's ranks and the replicas' ranks
(``gloo`` on the CPU, ``nccl`` on CUDA): every actor rank gathers one FSDP unit at a time, the bucket
owner casts its tensors to the rollout's dtype into the bucket and broadcasts it, and each replica copies
them into its model as they arrive; no rank holds the whole model (docs/async_training.md,
docs/benchmarks.md). ``backend=object_store`` (or ``enable=false``) is the older path: trainer rank 0
puts the whole model in Ray's object store and every replica fetches it.
"""

from __future__ import annotations

from omegaconf import DictConfig


def build_weight_sync(config: DictConfig, actor_group, rollout_group):
    """The :class:`~hybridflow.workers.checkpoint_engine.CheckpointEngineManager` of a fully-async
    ``config`` (its keys are read once, in :func:`~hybridflow.trainer.config.checkpoint_engine.
    fully_async_checkpoint_engine`), the engines built on both pools."""
    from hybridflow.trainer.config.checkpoint_engine import fully_async_checkpoint_engine
    from hybridflow.trainer.config.parallelism import device_type
    from hybridflow.workers.checkpoint_engine import CheckpointEngineManager
    from hybridflow.workers.rollout.engine_rollout import engine_dtype

    settings = fully_async_checkpoint_engine(config)
    dtype = engine_dtype(config.actor_rollout_ref.rollout.get("dtype"), device_type(config))
    return CheckpointEngineManager(
        settings.backend,
        actor_group,
        rollout_group,
        settings.bucket_megabytes,
        str(dtype),
        settings.engine_kwargs,
    )


def sync_parameters(manager, version: int) -> dict[str, float]:
    """Move the actor's current weights to every rollout replica as parameter ``version``; returns
    ``timing_s/param_sync`` and ``fully_async/param_sync/*`` (its parts, bytes, extra memory per side)."""
    return manager.update_weights(version)
