"""verl's checkpoint engine between a trainer's ranks and rollout replicas, on real Ray processes and a
real gloo group: two FSDP2 ranks of a tiny random decoder (:mod:`tests.tiny_configs`) and a replica
(:mod:`tests.workers.checkpoint_engine_workers`; three light processes keep the fast tier fast, the
slow tier's test below has two replicas).

- ``gloo`` with 4 KiB buckets, smaller than most tensors (the embedding, 97 x 64 fp32 = 24.8 KB, is
  **split over 7 buckets**, sent alternately by the two trainer ranks): after a sync every replica's
  weights equal the trainer's bitwise; the group is kept and a second sync of new weights is exact too;
- a bf16 rollout gets the trainer's weights rounded to bf16 (cast before sending), with half the bytes;
- ``object_store`` (the fallback) is exact;
- an unknown backend is refused naming the registered ones;
- slow tier: the same exactness through ``fully_async_main``'s own workers (the PPO actor worker and the
  standalone rollout worker with its engine), two ranks to two replicas.
"""

from __future__ import annotations

import pytest
import torch

KIB = 1 / 1024  # in MiB


@pytest.fixture(scope="module")
def pools(ray_session):
    """``(trainer group, replica group)``: two trainer ranks, one replica."""
    from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.workers.checkpoint_engine_workers import Replica, ShardedTrainer

    groups = [
        RayWorkerGroup(RayResourcePool([n], name_prefix=name), RayClassWithInitArgs(cls), name_prefix=name)
        for name, cls, n in (("ce_trainer", ShardedTrainer, 2), ("ce_replica", Replica, 1))
    ]
    from hybridflow.single_controller.ray.base import wait_futures

    wait_futures([group.init_model_async(seed) for group, seed in zip(groups, (0, 1), strict=True)])
    yield groups
    for group in groups:
        group.shutdown()


def _sync_and_compare(trainer, replicas, manager, version: int, dtype=torch.float32) -> tuple[dict, dict]:
    """Sync, then every replica's weights against the trainer's (cast to ``dtype``): bitwise."""
    expected = trainer.full_weights()[0]
    metrics = manager.update_weights(version)
    for rank, got in enumerate(replicas.weights()):
        assert sorted(got) == sorted(expected)
        for name, array in expected.items():
            want = torch.tensor(array).to(dtype).float()
            assert torch.equal(torch.tensor(got[name]), want), f"replica {rank}: {name} differs"
    return metrics, expected


@pytest.mark.slow  # make test-slow: the Ray pools take ~40 s to start (fast tier budget)
def test_gloo_buckets_smaller_than_a_tensor_give_every_replica_the_trainers_weights_bitwise(pools):
    from hybridflow.workers.checkpoint_engine import CheckpointEngineManager

    trainer, replicas = pools
    manager = CheckpointEngineManager("gloo", trainer, replicas, 4 * KIB, "torch.float32")
    trainer.perturb(1)
    metrics, weights = _sync_and_compare(trainer, replicas, manager, 1)
    assert max(array.nbytes for array in weights.values()) > 6 * 4096  # split over buckets
    assert metrics["fully_async/param_sync/sent_mb"] == pytest.approx(
        sum(array.nbytes for array in weights.values()) / 2**20, rel=0.05
    )
    trainer.perturb(2)
    _sync_and_compare(trainer, replicas, manager, 2)  # the same group, new weights


@pytest.mark.slow  # make test-slow: the Ray pools take ~40 s to start (fast tier budget)
def test_a_bf16_rollout_gets_the_weights_cast_before_sending(pools):
    from hybridflow.workers.checkpoint_engine import CheckpointEngineManager

    trainer, replicas = pools
    trainer.perturb(3)
    manager = CheckpointEngineManager("gloo", trainer, replicas, 64 * KIB, "torch.bfloat16")
    metrics, weights = _sync_and_compare(trainer, replicas, manager, 3, dtype=torch.bfloat16)
    fp32_mb = sum(array.nbytes for array in weights.values()) / 2**20
    assert metrics["fully_async/param_sync/sent_mb"] == pytest.approx(fp32_mb / 2, rel=0.05)


@pytest.mark.slow  # make test-slow: the Ray pools take ~40 s to start (fast tier budget)
def test_the_object_store_fallback_is_exact(pools):
    from hybridflow.workers.checkpoint_engine import CheckpointEngineManager

    trainer, replicas = pools
    trainer.perturb(4)
    manager = CheckpointEngineManager("object_store", trainer, replicas, 4 * KIB, "torch.float32")
    _sync_and_compare(trainer, replicas, manager, 4)


def test_an_unknown_backend_is_refused_naming_the_registered_ones():
    from hybridflow.utils.registry import RegistryError
    from hybridflow.workers.checkpoint_engine import CheckpointEngineRegistry

    with pytest.raises(RegistryError, match=r"Unknown checkpoint engine backend 'nixl'.*gloo.*object_store"):
        CheckpointEngineRegistry.new("nixl", 1 << 20)


@pytest.mark.slow  # make test-slow: four processes of fully_async_main's own workers (~45 s to start)
def test_fully_async_workers_sync_two_ranks_to_two_replicas_bitwise(
    ray_session, vllm_model_dir, arithmetic_data
):
    """The PPO actor worker (FSDP2, two ranks) to two standalone rollout workers (model + engine), built
    by ``fully_async_main``'s builders, through its default backend (gloo on the CPU), with buckets of
    16 KiB: each replica's model equals the trainer's weights bitwise."""
    import ray

    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.fully_async.main import build_rollout_group, check_config
    from hybridflow.trainer.fully_async.param_sync import build_weight_sync
    from hybridflow.trainer.ppo.workers_setup import build_worker_groups
    from tests.tiny_run import as_overrides, tiny_run_values

    values = tiny_run_values(
        vllm_model_dir,
        arithmetic_data,
        **{
            "trainer.n_gpus_per_node": 2,
            "rollout.n_gpus_per_node": 2,
            "actor_rollout_ref.rollout.kv_cache_memory_gb": 0.02,
            "async_training.checkpoint_engine.device_buffer_size_M": 1,
        },
    )
    config = load_config(as_overrides(values), config_name="fully_async_ppo_trainer")
    view = check_config(config)
    groups = build_worker_groups(view, False, False, hybrid=False)
    rollout = build_rollout_group(config, view)
    try:
        rollout.init_model_async()
        groups.init_models()
        rollout.init_model()
        actor = groups.actor_rollout
        manager = build_weight_sync(config, actor, rollout)
        assert manager.backend == "gloo"
        manager.update_weights(1)

        def trainer_weights(worker):
            from hybridflow.workers.checkpoint_engine import trainer_weight_stream

            worker = getattr(worker, "worker_dict", {}).get("actor_rollout", worker)
            return {n: t.float().clone() for n, t in trainer_weight_stream(worker.actor_module)}

        def replica_weights(worker):
            return {n: p.detach().clone() for n, p in worker.module.named_parameters()}

        expected = ray.get([w.__ray_call__.remote(trainer_weights) for w in actor._workers])[0]
        for got in ray.get([w.__ray_call__.remote(replica_weights) for w in rollout._workers]):
            assert sorted(got) == sorted(expected)
            assert all(torch.equal(got[name], expected[name]) for name in expected)
    finally:
        rollout.shutdown()
        groups.base.shutdown()
