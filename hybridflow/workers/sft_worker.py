"""A supervised fine-tuning worker on the same FSDP2 model-building code as the actor.

Used for the warm start before RL: cross-entropy on the response tokens (``loss_mask``), averaged
over the tokens of the whole mini-batch on this rank.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, register
from hybridflow.workers.fsdp_utils import full_state_dict, grad_norm_and_clip, set_gradient_sync
from hybridflow.workers.fsdp_workers import FSDPWorkerBase, _own_copy
from hybridflow.workers.model_builder import build_training_parts, load_hf_model, resolve_local_path


def sft_loss(model, micro: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, number of loss tokens)`` for next-token prediction on ``loss_mask``."""
    batch = micro.batch
    logits = (
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        )
        .logits[:, :-1]
        .float()
    )
    targets = batch["input_ids"][:, 1:]
    mask = batch["loss_mask"][:, 1:].float()
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum(), mask.sum()


class SFTWorker(FSDPWorkerBase):
    """``config`` is the SFT config (sections model, optim, data)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = _own_copy(config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg = self.config
        self.parts = build_training_parts(cfg.model, cfg.model.fsdp_config, cfg.optim, self.device_mesh)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def train_step(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's shard; returns train/loss, train/lr, train/grad_norm."""
        model, optimizer = self.parts.module, self.parts.optimizer
        model.train()
        micros = data.split(int(self.config.data.micro_batch_size_per_gpu))
        total_tokens = data.batch["loss_mask"][:, 1:].sum().clamp(min=1)
        loss_sum = 0.0
        for index, micro in enumerate(micros):
            set_gradient_sync(model, index == len(micros) - 1)
            token_loss_sum, _ = sft_loss(model, micro)
            (token_loss_sum / total_tokens).backward()
            loss_sum += float(token_loss_sum.detach())
        grad_norm = grad_norm_and_clip(model, float(self.config.optim.get("clip_grad", 1.0)))
        lr = self.parts.lr_scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.parts.lr_scheduler.step()
        metrics = {
            "train/loss": loss_sum / float(total_tokens),
            "train/lr": lr,
            "train/grad_norm": float(grad_norm),
        }
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_hf_model(self, target_dir: str) -> str:
        """Write the trained weights as a Hugging Face directory (collective; rank 0 writes)."""
        from hybridflow.models.loading import load_tokenizer

        state = full_state_dict(self.parts.module)
        if self.rank == 0:
            source = resolve_local_path(self.config.model.path)
            model = load_hf_model(self.config.model, "causal_lm", torch.float32)
            model.load_state_dict(state)
            os.makedirs(target_dir, exist_ok=True)
            model.save_pretrained(target_dir, safe_serialization=True)
            load_tokenizer(source).save_pretrained(target_dir)
            if os.path.exists(os.path.join(source, "generation_config.json")):
                import shutil

                shutil.copy(os.path.join(source, "generation_config.json"), target_dir)
        self.barrier()
        return target_dir
