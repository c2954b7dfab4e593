"""Weight sync between pools: the checkpoint engine's collective backend against the object store.

A randomly initialised model of ``--shape`` (SmolLM2-135M's by default, :data:`rollout_backends.SHAPES`),
FSDP2-sharded over ``--trainer-ranks`` Ray processes (one unit per decoder layer), is moved to
``--replicas`` Ray processes that each hold a plain copy, by each backend in turn (``--backends``,
``gloo,object_store``), ``--syncs`` times each (the first also builds the group). Each process runs one
torch thread. What is timed and measured is the checkpoint engine's path of ``fully_async_main``: every
trainer rank gathers one FSDP unit at a time, the bucket owners (gloo) or rank 0 (object store) cast to
the rollout's dtype and send, every replica copies the tensors into its model as they arrive. The
rollout engine's own refresh, the same for both, is left out.

    python benchmarks/weight_sync.py                       # SmolLM2-135M shape, 2 -> 2, 64 MiB buckets
    python benchmarks/weight_sync.py --shape smollm2 --bucket-mb 16 --trainer-ranks 1 --replicas 1

One JSON line per (backend, sync): ``seconds`` (the whole sync, as the trainer logs it), ``setup_s``
(prepare + group), ``send_s`` per trainer rank, ``load_s`` per replica, and per rank the resident set
before the sync and its peak during it (``extra_mb`` = peak - before: what the sync itself holds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, os.path.dirname(__file__))
from rollout_backends import SHAPES  # noqa: E402  (benchmarks/ is on the path of its scripts)


def _worker_classes():
    """The trainer and replica worker classes (defined here, sent to Ray by value)."""
    import torch

    from hybridflow.single_controller import Dispatch, Worker, register
    from hybridflow.workers.checkpoint_engine.manager import CheckpointEngineWorker

    def build(shape: dict, seed: int):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**shape)).eval()

    class Trainer(CheckpointEngineWorker, Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model(self, shape: dict) -> None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            torch.set_num_threads(1)
            self.init_process_group()
            model = build(shape, 0)
            mesh = init_device_mesh("cpu", (self.world_size,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            self.actor_module = fully_shard(model, mesh=mesh)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def send_weights_by_checkpoint_engine(self) -> tuple:
            from hybridflow.workers.checkpoint_engine import measured_sync, trainer_weight_stream

            engine = self.checkpoint_engine
            stream = trainer_weight_stream(self.actor_module)
            payload, stats = measured_sync(lambda: engine.send_weights(stream))
            return payload, {**engine.stats, **stats}

    class Replica(CheckpointEngineWorker, Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model(self, shape: dict) -> None:
            torch.set_num_threads(1)
            self.module = build(shape, 1)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def receive_weights_by_checkpoint_engine(self, version: int, payload=None) -> dict:
            from hybridflow.workers.checkpoint_engine import load_received, measured_sync

            received = self.checkpoint_engine.receive_weights(payload)
            loaded, stats = measured_sync(lambda: load_received(self.module, received))
            return {**loaded, **stats, "engine_sync_s": 0.0}

    return Trainer, Replica


def _per_rank(stats: list[dict], key: str) -> list[float]:
    return [round(float(s[key]), 3) for s in stats]


def run(args) -> None:
    import ray

    from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from hybridflow.single_controller.ray.base import wait_futures
    from hybridflow.workers.checkpoint_engine import CheckpointEngineManager

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    trainer_cls, replica_cls = _worker_classes()
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    groups = [
        RayWorkerGroup(
            RayResourcePool([n], name_prefix=name), RayClassWithInitArgs(cls), name_prefix=name, env=env
        )
        for name, cls, n in (
            ("trainer", trainer_cls, args.trainer_ranks),
            ("replica", replica_cls, args.replicas),
        )
    ]
    wait_futures([group.init_model_async(SHAPES[args.shape]) for group in groups])
    for backend in args.backends.split(","):
        manager = CheckpointEngineManager(backend, *groups, args.bucket_mb, args.dtype)
        for sync in range(args.syncs):
            metrics = manager.update_weights(sync + 1)
            trainer, rollout = manager.last_stats["trainer"], manager.last_stats["rollout"]
            record = {
                "benchmark": "weight_sync",
                "backend": backend,
                "sync": sync,
                "shape": args.shape,
                "trainer_ranks": args.trainer_ranks,
                "replicas": args.replicas,
                "bucket_mb": args.bucket_mb,
                "dtype": args.dtype,
                "seconds": round(metrics["timing_s/param_sync"], 3),
                "setup_s": round(metrics["fully_async/param_sync/setup_s"], 3),
                "sent_mb": round(metrics["fully_async/param_sync/sent_mb"], 1),
                "send_s": _per_rank(trainer, "seconds"),
                "load_s": _per_rank(rollout, "load_s"),
                "trainer_rss_before_mb": _per_rank(trainer, "rss_before_mb"),
                "trainer_peak_rss_mb": _per_rank(trainer, "peak_rss_mb"),
                "trainer_extra_mb": [round(s["peak_rss_mb"] - s["rss_before_mb"], 1) for s in trainer],
                "replica_rss_before_mb": _per_rank(rollout, "rss_before_mb"),
                "replica_peak_rss_mb": _per_rank(rollout, "peak_rss_mb"),
                "replica_extra_mb": [round(s["peak_rss_mb"] - s["rss_before_mb"], 1) for s in rollout],
            }
            print(json.dumps(record), flush=True)
    for group in groups:
        group.shutdown()
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--trainer-ranks", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="MiB per bucket (the CPU default)")
    parser.add_argument("--dtype", default="torch.float32", help="the rollout's dtype (what is sent)")
    parser.add_argument("--backends", default="gloo,object_store")
    parser.add_argument("--syncs", type=int, default=2)
    args = parser.parse_args()
    start = time.perf_counter()
    run(args)
    print(
        json.dumps({"benchmark": "weight_sync", "wall_s": round(time.perf_counter() - start, 1)}), flush=True
    )


if __name__ == "__main__":
    main()
