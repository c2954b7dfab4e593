"""The data-parallel PPO critic: per-token values V(s_t) and the clipped value-loss update.

The critic is the language model with a scalar head (``AutoModelForTokenClassification`` with one
label, as in verl); the value of response token t is read at the position that predicts it.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow import keys
from hybridflow.algorithms import compute_value_loss
from hybridflow.protocol import DataProto
from hybridflow.workers.forward import pad_responses, response_outputs
from hybridflow.workers.fsdp_utils import grad_norm_and_clip, set_gradient_sync
from hybridflow.workers.micro_batch import global_batch_info, restore_order, split_micro_batches
from hybridflow.workers.ulysses import loss_dp_group, sequence_parallel_state, sequence_parallel_values


def forward_values(model: nn.Module, micro: DataProto) -> torch.Tensor:
    """Values of the response positions: (b, T_r), zero outside ``response_mask`` (split over the
    model's sequence-parallel group when it has one: :mod:`hybridflow.workers.ulysses`)."""
    if sequence_parallel_state(model) is not None:
        per_token = sequence_parallel_values(model, micro)
    else:
        per_token = response_outputs(model, micro)[..., 0]
    values = pad_responses(per_token, micro.batch[keys.RESPONSES].shape[1])
    return values * micro.batch[keys.RESPONSE_MASK]


class DataParallelPPOCritic:
    """``config`` is the ``critic`` section, with ``ppo_mini_batch_size`` in responses per rank."""

    def __init__(self, config, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.config = config
        self.module = module
        self.optimizer = optimizer

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        cfg = self.config
        self.module.eval()
        micros, order = split_micro_batches(
            data, cfg.forward_micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.forward_max_token_len_per_gpu
        )
        return restore_order(torch.cat([forward_values(self.module, m) for m in micros]), order)

    def update_critic(self, data: DataProto) -> dict[str, list]:
        """Value-loss epochs over mini-batches (needs values, returns, response_mask)."""
        cfg = self.config
        step = int(data.meta_info.get("global_steps", 0))
        self.module.train()
        metrics: dict[str, list] = {}
        size = int(cfg.ppo_mini_batch_size)
        if len(data) % size:
            raise ValueError(
                f"critic update: {len(data)} rows per rank do not divide into mini-batches of {size}"
            )
        for epoch in range(int(cfg.ppo_epochs)):
            shuffled = data
            if cfg.shuffle:
                generator = torch.Generator().manual_seed(step * 1000 + epoch)
                shuffled = data.select_idxs(torch.randperm(len(data), generator=generator))
            for mini in shuffled.split(size):
                self._update_mini_batch(mini, metrics)
        return metrics

    def _update_mini_batch(self, mini: DataProto, metrics: dict[str, list]) -> None:
        """One optimizer step on a mini-batch; each micro-batch's value loss is its share of the
        mini-batch's (normalised over all micro-batches and ranks, as the actor's)."""
        cfg = self.config
        scale = cfg.get("loss_scale_factor")
        info = global_batch_info(mini, None if scale is None else float(scale), loss_dp_group(self.module))
        micros, _ = split_micro_batches(
            mini, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu
        )
        vf_loss_total = 0.0
        for index, micro in enumerate(micros):
            set_gradient_sync(self.module, index == len(micros) - 1)
            vpreds = forward_values(self.module, micro)
            mask = micro.batch[keys.RESPONSE_MASK].float()
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds,
                micro.batch[keys.RETURNS],
                micro.batch[keys.VALUES],
                mask,
                float(cfg.cliprange_value),
                cfg.loss_agg_mode,
                *info,
            )
            vf_loss.backward()
            vf_loss_total += float(vf_loss.detach())
            metrics.setdefault("critic/vf_clipfrac", []).append(float(vf_clipfrac))
            vpred_mean = (vpreds.detach() * mask).sum() / mask.sum().clamp(min=1)
            metrics.setdefault("critic/vpred_mean", []).append(float(vpred_mean))
        metrics.setdefault("critic/vf_loss", []).append(vf_loss_total)
        grad_norm = grad_norm_and_clip(self.module, float(cfg.grad_clip))
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            metrics.setdefault("critic/grad_norm_nonfinite_skipped", []).append(1.0)
        metrics.setdefault("critic/grad_norm", []).append(float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
