"""Two light worker classes for the checkpoint-engine tests: an FSDP2-sharded trainer of a tiny random
decoder (:mod:`tests.tiny_configs`) and a replica holding a plain copy, each with the engine's worker
methods. Real Ray processes, a real gloo group and a real model: only the PPO machinery and the
rollout engine are left out, so the processes start in seconds."""

from __future__ import annotations

import torch

from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.checkpoint_engine.manager import CheckpointEngineWorker


def tiny_model(seed: int):
    """The tiny Qwen2 decoder with weights drawn from ``seed`` (embedding 97 x 64 fp32: 24.8 KB)."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_configs import tiny_decoder_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_decoder_config("qwen2")).eval()


def _numpy(named) -> dict:
    return {name: tensor.detach().float().clone().numpy() for name, tensor in named}


class ShardedTrainer(CheckpointEngineWorker, Worker):
    """The actor's side: the tiny model sharded over the group's ranks (one FSDP unit per layer)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, seed: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        self.init_process_group()
        model = tiny_model(seed)
        mesh = init_device_mesh("cpu", (self.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        self.actor_module = fully_shard(model, mesh=mesh)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def perturb(self, seed: int) -> None:
        """New weights: noise added to this rank's shards (no collective)."""
        generator = torch.Generator().manual_seed(seed * 100 + self.rank)
        with torch.no_grad():
            for param in self.actor_module.parameters():
                local = param.to_local()
                local.add_(torch.randn(local.shape, generator=generator) * 0.01)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_weights(self) -> dict | None:
        """Rank 0: ``{HF name: fp32 array}`` gathered (a collective)."""
        from hybridflow.workers.checkpoint_engine import trainer_weight_stream

        found = _numpy(trainer_weight_stream(self.actor_module))
        return found if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights_by_checkpoint_engine(self) -> tuple:
        from hybridflow.workers.checkpoint_engine import measured_sync, trainer_weight_stream

        engine = self.checkpoint_engine
        payload, stats = measured_sync(lambda: engine.send_weights(trainer_weight_stream(self.actor_module)))
        return payload, {**engine.stats, **stats}


class Replica(CheckpointEngineWorker, Worker):
    """The rollout's side: a plain copy of the model (other weights until a sync)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, seed: int) -> None:
        torch.set_num_threads(1)
        self.module = tiny_model(seed)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict:
        return _numpy(self.module.named_parameters())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights_by_checkpoint_engine(self, version: int, payload=None) -> dict:
        from hybridflow.workers.checkpoint_engine import load_received, measured_sync

        received = self.checkpoint_engine.receive_weights(payload)
        loaded, stats = measured_sync(lambda: load_received(self.module, received))
        self.version = int(version)
        return {**loaded, **stats, "engine_sync_s": 0.0}
