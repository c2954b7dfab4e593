"""Which checkpoint engine a run moves its weights with (verl's keys), derived here once and checked
before Ray starts (:mod:`hybridflow.workers.checkpoint_engine` has the backends).

- ``actor_rollout_ref.rollout.checkpoint_engine`` (verl's section): ``backend`` (verl's default
  ``naive``), ``update_weights_bucket_megabytes`` (2048) and ``engine_kwargs`` (``{backend: {...}}``).
- ``async_training.checkpoint_engine`` (verl's fully-async switch): ``enable`` (true),
  ``device_buffer_size_M`` (the bucket; verl's 4096 on CUDA) and ``overlap_broadcast_and_consume``.

``main_ppo`` colocates trainer and rollout (the hybrid engine): only ``naive``, the in-place hand-off,
applies, and the bucket keys do nothing there. ``fully_async_main`` moves the weights between pools:
with ``enable`` the backend is ``backend`` (null: ``gloo`` on the CPU, ``nccl`` on CUDA); without it,
``object_store`` (the whole model through Ray's object store: verl's per-tensor path has no
counterpart here).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from hybridflow.trainer.config.parallelism import device_type

SECTION = "actor_rollout_ref.rollout.checkpoint_engine"
ASYNC_SECTION = "async_training.checkpoint_engine"
BUCKET_MB = {"cuda": 4096, "cpu": 64}  # null device_buffer_size_M: verl's on CUDA; host RAM on the CPU


@dataclass(frozen=True)
class CheckpointEngineSettings:
    """A fully-async run's weight transfer: a registered ``backend``, buckets of ``bucket_megabytes``
    MiB, and the backend's own ``engine_kwargs``."""

    backend: str
    bucket_megabytes: int
    engine_kwargs: dict


def fully_async_checkpoint_engine(config: DictConfig) -> CheckpointEngineSettings:
    """The settings of a (checked) fully-async ``config``."""
    from hybridflow.workers.checkpoint_engine.base import default_backend

    section, device = OmegaConf.select(config, SECTION), device_type(config)
    switch = OmegaConf.select(config, ASYNC_SECTION)
    backend = section.backend or default_backend(device)
    if not switch.enable:
        backend = "object_store"
    megabytes = section.update_weights_bucket_megabytes or switch.device_buffer_size_M or BUCKET_MB[device]
    kwargs = OmegaConf.to_container(section.engine_kwargs, resolve=True) or {}
    return CheckpointEngineSettings(backend, int(megabytes), dict(kwargs.get(backend) or {}))


def fully_async_checkpoint_engine_problems(config: DictConfig) -> list[str]:
    """One line per checkpoint-engine setting a fully-async run cannot honour."""
    from hybridflow.workers.checkpoint_engine.base import CHECKPOINT_ENGINES, backend_problem

    section, switch = OmegaConf.select(config, SECTION), OmegaConf.select(config, ASYNC_SECTION)
    problems = []
    if switch.overlap_broadcast_and_consume:
        problems.append(
            f"{ASYNC_SECTION}.overlap_broadcast_and_consume=true is not implemented: each bucket is copied "
            "into the replica's model before the next is received (one bucket per rank); set false"
        )
    if not switch.enable and section.backend not in (None, "object_store"):
        problems.append(
            f"{ASYNC_SECTION}.enable=false moves the weights through Ray's object store, but "
            f"{SECTION}.backend={section.backend}; set one of them"
        )
    buckets = (section.update_weights_bucket_megabytes, switch.device_buffer_size_M)
    if None not in buckets and buckets[0] != buckets[1]:
        problems.append(
            f"{SECTION}.update_weights_bucket_megabytes={buckets[0]} and {ASYNC_SECTION}.device_buffer_size_M"
            f"={buckets[1]} both size the bucket; set one"
        )
    if any(value is not None and int(value) < 1 for value in buckets):
        problems.append(f"the checkpoint engine's bucket must be >= 1 MiB, got {buckets}")
        return problems
    settings = fully_async_checkpoint_engine(config)
    problem = backend_problem(settings.backend, device_type(config), colocated=False)
    if problem:
        return [*problems, problem]
    allowed = getattr(CHECKPOINT_ENGINES.get(settings.backend), "engine_kwargs_keys", ())
    unknown = sorted(set(settings.engine_kwargs) - set(allowed))
    if unknown:
        problems.append(
            f"{SECTION}.engine_kwargs.{settings.backend} has {unknown}; {settings.backend} takes "
            f"{list(allowed) or 'none'}"
        )
    return problems


def colocated_checkpoint_engine_problems(config: DictConfig, defaults: DictConfig) -> list[str]:
    """``main_ppo`` (trainer and rollout in one process): only ``naive``; the bucket keys, which the
    in-place hand-off does not read, only at ``defaults``."""
    from hybridflow.workers.checkpoint_engine.base import backend_problem

    section, default = OmegaConf.select(config, SECTION), OmegaConf.select(defaults, SECTION)
    problem = backend_problem(str(section.backend), device_type(config), colocated=True)
    problems = [problem] if problem else []
    for key in ("update_weights_bucket_megabytes", "engine_kwargs"):
        value = OmegaConf.to_container(section, resolve=True).get(key)
        if value != OmegaConf.to_container(default, resolve=True).get(key):
            problems.append(
                f"{SECTION}.{key}={value} does nothing in main_ppo: the colocated (naive) sync hands the "
                "weights over in place, one FSDP unit at a time; it sizes fully_async_main's transfer"
            )
    return problems
