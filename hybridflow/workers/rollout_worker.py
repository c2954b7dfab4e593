"""The standalone rollout worker: a generation replica on a pool of its own (the asynchronous trainer's
rollouter), not sharing a process with the actor.

It holds a plain (unsharded) copy of the model and the rollout engine built over it (hybridflow's or
vLLM, ``rollout.name``), serves requests with the same serve loop as the hybrid worker
(:func:`~hybridflow.workers.rollout.replica.serve_requests`), and takes new weights with a parameter
version through its checkpoint engine (:meth:`receive_weights_by_checkpoint_engine`;
:mod:`hybridflow.workers.checkpoint_engine`): the trainer's actor sends them
(:meth:`~hybridflow.workers.fsdp_workers.ActorRolloutRefWorker.send_weights_by_checkpoint_engine`).
"""

from __future__ import annotations

import torch

from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.checkpoint_engine.manager import CheckpointEngineWorker
from hybridflow.workers.model_builder import load_hf_model, resolve_local_path
from hybridflow.workers.rollout.base import get_rollout_cls


class StandaloneRolloutWorker(CheckpointEngineWorker, Worker):
    """``config``: the ``actor_rollout_ref`` section (model + rollout)."""

    def __init__(self, config) -> None:
        super().__init__()
        from omegaconf import OmegaConf

        self.config = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
        self.weight_version = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hybridflow.models.loading import get_generation_eos_ids, load_tokenizer

        cfg = self.config
        path = resolve_local_path(cfg.model.path)
        trust = bool(cfg.model.get("trust_remote_code", False))
        self.tokenizer = load_tokenizer(
            path, trust_remote_code=trust, custom_chat_template=cfg.model.get("custom_chat_template")
        )
        self.eos_token_ids = get_generation_eos_ids(path, trust_remote_code=trust)
        device = "cuda" if self.device_type() == "cuda" else "cpu"
        self.module = load_hf_model(cfg.model, "causal_lm", torch.float32).to(device).eval()
        cls = get_rollout_cls(cfg.rollout.name)
        kwargs = {"rank": self.rank, "tokenizer": self.tokenizer}
        if getattr(cls, "reads_model_directory", False):
            kwargs.update(model_path=path, trust_remote_code=trust)
        self.rollout = cls(self.module, cfg.rollout, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights_by_checkpoint_engine(self, version: int, payload=None) -> dict[str, float]:
        """Take the trainer's weights from this rank's checkpoint engine into the model (each tensor
        copied as it arrives), then into the engine; this replica now generates with parameter
        ``version``. ``payload``: trainer rank 0's send result, for backends that read it
        (``object_store``). Returns timings and the resident set before and at peak."""
        from hybridflow.workers.checkpoint_engine import load_received, measured_sync

        received = self.checkpoint_engine.receive_weights(payload)
        loaded, stats = measured_sync(lambda: load_received(self.module, received))
        metrics = self.rollout.update_weights()
        self.weight_version = int(version)
        return {**loaded, **stats, "engine_sync_s": float(metrics.get("update_weights", 0.0))}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_wake_up(self, rows: int | None = None) -> dict:
        """Before serving: the KV cache at full size (a standalone replica streams without a known
        batch; nothing trains beside it), the weights already the latest loaded."""
        self.rollout.resume()
        return {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_sleep(self) -> None:
        """A standalone replica keeps its cache between serving phases (nothing trains beside it)."""

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def serve_requests(self, server) -> dict:
        """Serve ``server``'s requests until it says stop (see the hybrid worker's method)."""
        from hybridflow.workers.rollout.engine_rollout import engine_sampling_params
        from hybridflow.workers.rollout.replica import serve_requests

        defaults = engine_sampling_params(self.config.rollout, {}, self.eos_token_ids)
        with torch.no_grad():
            return serve_requests(self.rollout.engine, server, defaults, weight_version=self.weight_version)
