"""The data-parallel PPO actor: log-probs of responses and the clipped policy update.

One instance lives in each rank of the actor worker group and owns that rank's FSDP2 shard of the
policy. Mini-batches (``ppo_mini_batch_size`` prompts x ``rollout.n`` responses, divided over the
ranks) give one optimizer step each; micro-batches inside accumulate gradients.

Loss of a mini-batch (PPO, Schulman et al. 2017, with verl's extensions)::

    loss = pg_loss(old_log_probs, log_probs, advantages)      # any registered policy loss
         - entropy_coeff * entropy                            # token entropy of the current policy
         + kl_loss_coef  * KL(pi || pi_ref)                   # use_kl_loss (GRPO-style KL in the loss)

Each term is aggregated with ``loss_agg_mode`` over the *whole mini-batch* — every micro-batch and
every dp rank (``batch_num_tokens`` / ``global_batch_size`` from one all-reduce per mini-batch, see
:mod:`hybridflow.algorithms.loss_agg`) — so micro-batches of different sizes (dynamic batch size,
trimmed padding) are weighted exactly as if the mini-batch were one batch.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hybridflow import keys
from hybridflow.algorithms import (
    DistillConfig,
    GlobalBatchInfo,
    PolicyLossConfig,
    PolicyLossInputs,
    agg_loss,
    compute_policy_loss,
    kl_penalty,
)
from hybridflow.protocol import DataProto
from hybridflow.utils.rollout_parity import rollout_parity_metrics
from hybridflow.utils.torch_functional import entropy_from_logits, logprobs_from_logits
from hybridflow.workers.actor.distill import distill_forward, distilling
from hybridflow.workers.forward import pad_responses, response_outputs
from hybridflow.workers.fsdp_utils import grad_norm_and_clip, set_gradient_sync
from hybridflow.workers.micro_batch import global_batch_info, restore_order, split_micro_batches
from hybridflow.workers.router_replay import RECORD, REPLAY, acting, install, recorded_ids, replay_mode
from hybridflow.workers.tensor_parallel import (
    tensor_parallel_state,
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
)
from hybridflow.workers.ulysses import loss_dp_group, sequence_parallel_log_probs, sequence_parallel_state

# Loss terms whose per-micro-batch values are shares of the mini-batch value: their metric is the sum.
_SUMMED_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/distill_loss")


def forward_response_logits(model: nn.Module, micro: DataProto, temperature: float) -> torch.Tensor:
    """Logits predicting each kept response token: (b, T_k, V) with T_k <= T_r (trailing padding
    trimmed, see :mod:`hybridflow.workers.forward`), divided by the sampling temperature."""
    logits = response_outputs(model, micro)
    return logits / temperature if temperature not in (0, 1.0) else logits


def response_log_probs(
    model: nn.Module,
    micro: DataProto,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs (b, T_r), entropy (b, T_r) | None)`` of ``micro[responses]``; 0 in the trimmed
    trailing padding columns (outside ``response_mask``). ``entropy_grad=False``: the entropy is only
    reported, so it is computed off the autograd graph. A sequence-parallel model splits each sequence
    over its group and returns the same whole-sequence tensors (:mod:`hybridflow.workers.ulysses`)."""
    responses = micro.batch[keys.RESPONSES]
    if sequence_parallel_state(model) is not None:
        log_probs, entropy = sequence_parallel_log_probs(
            model, micro, temperature, with_entropy, entropy_grad
        )
        entropy = None if entropy is None else pad_responses(entropy, responses.shape[1])
        return pad_responses(log_probs, responses.shape[1]), entropy
    logits = forward_response_logits(model, micro, temperature)
    tp = tensor_parallel_state(model)  # tensor-parallel: logits hold this rank's vocabulary slice
    labels = responses[:, : logits.shape[1]]
    if tp is None:
        log_probs = logprobs_from_logits(logits, labels)
    else:
        log_probs = vocab_parallel_log_probs(logits, labels, tp)
    entropy = None
    if with_entropy:
        kept = logits if entropy_grad else logits.detach()
        entropy = entropy_from_logits(kept) if tp is None else vocab_parallel_entropy(kept, tp)
        entropy = pad_responses(entropy, responses.shape[1])
    return pad_responses(log_probs, responses.shape[1]), entropy


def policy_loss_config(actor_cfg) -> PolicyLossConfig:
    """The actor config section (verl keys) as the algorithms' PolicyLossConfig; the section itself
    stays reachable (``config.<any actor key>``) for verl-signature losses that read other keys."""
    return PolicyLossConfig.from_config(actor_cfg)


class DataParallelPPOActor:
    """Policy forward and update for one rank. ``config`` is the ``actor_rollout_ref.actor`` section,
    with ``ppo_mini_batch_size`` already converted to responses per rank by the worker."""

    def __init__(
        self,
        config,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        response_length: int | None = None,
    ) -> None:
        self.config = config
        self.module = module
        self.optimizer = optimizer
        self.loss_config = policy_loss_config(config) if optimizer is not None else None  # ref: no update
        # on-policy distillation (the teacher's top-k in the batch): workers/actor/distill.py
        self.distill_config = DistillConfig.from_config(config.get("distill_loss")) if config else None
        # seq-mean-token-sum-norm's constant divisor: actor.loss_scale_factor, else the configured
        # maximum response length (verl's default, the padded response width).
        scale = config.get("loss_scale_factor") if config is not None else None
        self.loss_scale_factor = float(scale) if scale is not None else response_length
        # MoE router replay (workers/router_replay.py): hooks only when configured; R2's recorded ids
        self.router_replay = replay_mode(config) if config is not None else "disabled"
        self.recorded_routing: torch.Tensor | None = None
        if self.router_replay != "disabled":
            install(module)

    # ------------------------------------------------------------------ log-probs
    def _forward(self, micro: DataProto, temperature: float, with_entropy: bool):
        return response_log_probs(self.module, micro, temperature, with_entropy)

    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, batching, calculate_entropy: bool = False):
        """``(log_probs (B, T_r), entropy (B, T_r) | None)`` of ``data[responses]`` under the current
        weights; ``data.meta_info["temperature"]`` scales the logits as in sampling. ``batching`` is the
        config section with ``log_prob_micro_batch_size_per_gpu``, ``log_prob_use_dynamic_bsz`` and
        ``log_prob_max_token_len_per_gpu`` (``rollout`` or ``ref``)."""
        temperature = float(data.meta_info.get("temperature", 1.0))
        self.module.eval()
        micros, order = split_micro_batches(
            data,
            batching.log_prob_micro_batch_size_per_gpu,
            batching.log_prob_use_dynamic_bsz,
            batching.log_prob_max_token_len_per_gpu,
        )
        action = {"R3": REPLAY, "R2": RECORD if self.optimizer is not None else None}.get(self.router_replay)
        recorded = []
        with acting(self.module, action) as replay:
            outputs = []
            for micro in micros:
                outputs.append(self._forward(micro, temperature, calculate_entropy))
                if action == RECORD:  # R2: the routing this pass took, for the update to replay
                    recorded.append(recorded_ids(replay, micro))
        self.recorded_routing = restore_order(torch.cat(recorded), order) if recorded else None
        log_probs = restore_order(torch.cat([lp for lp, _ in outputs]), order)
        entropy = restore_order(torch.cat([e for _, e in outputs]), order) if calculate_entropy else None
        return log_probs, entropy

    # ------------------------------------------------------------------ update
    def _micro_loss(
        self, micro: DataProto, temperature: float, info: GlobalBatchInfo
    ) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """This micro-batch's share of the mini-batch loss (``info``: the mini-batch it belongs to),
        its metrics, and — when they served as the old policy's — its log-probs (b, T_r), detached."""
        cfg = self.config
        entropy_in_loss = float(cfg.entropy_coeff) != 0
        # No old_log_probs: the trainer found this update's forward to be the old policy's (one PPO
        # epoch, one mini-batch per step), so they are this forward's own log-probs, detached.
        on_policy = keys.OLD_LOG_PROBS not in micro.batch.keys()
        distill = self.distill_config if distilling(micro) else None
        if distill is None:
            log_probs, entropy = response_log_probs(
                self.module, micro, temperature, entropy_in_loss or on_policy, entropy_grad=entropy_in_loss
            )
        else:  # the same forward also gives the student's logits for the teacher's top-k
            log_probs, entropy, distill_loss, distill_metrics = distill_forward(
                forward_response_logits(self.module, micro, temperature), micro,
                entropy_in_loss or on_policy, entropy_in_loss, distill, info, cfg.loss_agg_mode,
            )  # fmt: skip
        mask = micro.batch[keys.RESPONSE_MASK].float()
        inputs = PolicyLossInputs(
            old_log_prob=log_probs.detach() if on_policy else micro.batch[keys.OLD_LOG_PROBS],
            log_prob=log_probs,
            advantages=micro.batch[keys.ADVANTAGES],
            response_mask=mask,
            rollout_is_weights=micro.batch.get(keys.ROLLOUT_IS_WEIGHTS, None),  # rollout correction
        )
        loss_config = dataclasses.replace(
            self.loss_config,
            dp_size=info.dp_size,
            batch_num_tokens=info.batch_num_tokens,
            global_batch_size=info.global_batch_size,
            loss_scale_factor=info.loss_scale_factor,
        )
        pg_loss, metrics = compute_policy_loss(inputs, loss_config)
        loss = pg_loss
        metrics = {k: float(v) for k, v in metrics.items()}
        if distill is not None:  # pure distillation leaves the policy loss out of the gradient
            loss = (pg_loss if distill.use_policy_loss else 0.0) + distill_loss
            metrics.update(distill_metrics)
        metrics["actor/pg_loss"] = float(pg_loss.detach())
        if entropy_in_loss:
            entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, *info)
            loss = loss - float(cfg.entropy_coeff) * entropy_loss
            metrics["actor/entropy"] = float(entropy_loss.detach())
        elif on_policy:  # what the skipped old-log-prob pass would have reported: the token-mean entropy
            metrics["actor/entropy"] = float(agg_loss(entropy, mask, "token-mean", *info))
        if cfg.use_kl_loss:
            kld = kl_penalty(log_probs, micro.batch[keys.REF_LOG_PROB], cfg.kl_loss_type)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, *info)
            loss = loss + float(cfg.kl_loss_coef) * kl_loss
            metrics["actor/kl_loss"] = float(kl_loss.detach())
            metrics["actor/kl_coef"] = float(cfg.kl_loss_coef)
        return loss, metrics, inputs.old_log_prob if on_policy else None

    def _optimizer_step(self, metrics: dict[str, list]) -> None:
        grad_norm = grad_norm_and_clip(self.module, float(self.config.grad_clip))
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:  # skip the step; the norm (inf/nan) is reported, nothing is applied
            metrics.setdefault("actor/grad_norm_nonfinite_skipped", []).append(1.0)
        metrics.setdefault("actor/grad_norm", []).append(float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)

    def accumulate_gradients(self, mini: DataProto, temperature: float, metrics: dict[str, list]) -> None:
        """Forward/backward every micro-batch of one mini-batch; gradients accumulate in the module
        (reduced over the ranks on the last micro-batch). Metrics are appended to ``metrics``."""
        cfg = self.config
        info = global_batch_info(mini, self.loss_scale_factor, loss_dp_group(self.module))
        micros, _ = split_micro_batches(
            mini, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu
        )
        summed: dict[str, float] = {}
        parity_parts = []
        for index, micro in enumerate(micros):
            self._set_grad_sync(index == len(micros) - 1)
            loss, micro_metrics, old_log_probs = self._micro_loss(micro, temperature, info)
            loss.backward()
            if old_log_probs is not None and keys.ROLLOUT_LOG_PROBS in micro.batch.keys():
                rollout = micro.batch[keys.ROLLOUT_LOG_PROBS]
                parity_parts.append((rollout, old_log_probs, micro.batch[keys.RESPONSE_MASK]))
            for key, value in micro_metrics.items():
                if key in _SUMMED_METRICS:
                    summed[key] = summed.get(key, 0.0) + value
                else:
                    metrics.setdefault(key, []).append(value)
        for key, value in summed.items():
            metrics.setdefault(key, []).append(value)
        if parity_parts:  # the engine's log-probs against the ones this update used as the old policy's
            rollout, current, mask = (torch.cat(parts) for parts in zip(*parity_parts, strict=True))
            for key, value in rollout_parity_metrics(rollout, current, mask).items():
                metrics.setdefault(key, []).append(value)

    def update_policy(self, data: DataProto) -> dict[str, list]:
        """PPO epochs over mini-batches of ``data`` (needs responses, input_ids, attention_mask,
        position_ids, response_mask, old_log_probs, advantages, and ref_log_prob with use_kl_loss)."""
        cfg = self.config
        temperature = float(data.meta_info.get("temperature", 1.0))
        step = int(data.meta_info.get("global_steps", 0))
        self.module.train()
        metrics: dict[str, list] = {}
        # router replay: R3 the rollout's ids, R2 the old-log-prob pass's (none: that pass was skipped,
        # the update's own forward is the old policy's and routes as it did)
        replays = self.router_replay == "R3" or (
            self.router_replay == "R2" and keys.ROUTED_EXPERTS in data.batch.keys()
        )
        with acting(self.module, REPLAY if replays else None):
            for epoch in range(int(cfg.ppo_epochs)):
                for mini in self._mini_batches(data, seed=step * 1000 + epoch):
                    self.accumulate_gradients(mini, temperature, metrics)
                    self._optimizer_step(metrics)
        return metrics

    def _mini_batches(self, data: DataProto, seed: int) -> list[DataProto]:
        size = int(self.config.ppo_mini_batch_size)
        if len(data) % size:
            raise ValueError(
                f"actor update: {len(data)} rows per rank do not divide into mini-batches of {size}"
            )
        if self.config.shuffle:
            generator = torch.Generator().manual_seed(seed)
            data = data.select_idxs(torch.randperm(len(data), generator=generator))
        return data.split(size)

    def _set_grad_sync(self, sync: bool) -> None:
        """Reduce-scatter gradients only on the last micro-batch of a mini-batch (FSDP2)."""
        set_gradient_sync(self.module, sync)
