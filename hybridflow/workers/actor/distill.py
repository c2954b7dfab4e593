"""The actor's distillation term: one forward gives the policy's log-probs and the student's logits.

When a micro-batch carries the teacher's top-k (``teacher_topk_logps`` / ``teacher_topk_indices``, each
(b, T_r, k), from :mod:`hybridflow.trainer.distill`), the actor's loss becomes (verl's gkd recipe)::

    loss = [pg_loss, if distill_loss.use_policy_loss] + distill_loss.loss_coef * agg(l_t)
           - entropy_coeff * entropy + kl_loss_coef * KL(pi || pi_ref)

with ``l_t`` a registered distillation loss (:mod:`hybridflow.algorithms.distillation`) on the logits
the log-probs come from (divided by the rollout temperature, as every log-prob of the actor), aggregated
with the actor's ``loss_agg_mode`` over the whole mini-batch like every other term.
"""

from __future__ import annotations

import torch

from hybridflow import keys
from hybridflow.algorithms import DISTILL_LOSSES, DistillConfig, GlobalBatchInfo, agg_loss
from hybridflow.algorithms.distillation import teacher_mass
from hybridflow.protocol import DataProto
from hybridflow.utils.torch_functional import entropy_from_logits, logprobs_from_logits
from hybridflow.workers.forward import pad_responses


def distilling(micro: DataProto) -> bool:
    return keys.TEACHER_TOPK_IDS in micro.batch.keys()


def distill_forward(
    logits: torch.Tensor,
    micro: DataProto,
    with_entropy: bool,
    entropy_grad: bool,
    config: DistillConfig,
    info: GlobalBatchInfo,
    loss_agg_mode: str,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """``(log_probs (b, T_r), entropy (b, T_r) | None, weighted distillation loss (scalar), metrics)``
    from ``logits`` (b, T_k, V), T_k <= T_r: the actor's forward over ``micro`` (temperature applied)."""
    kept = logits.shape[1]
    responses = micro.batch[keys.RESPONSES]
    log_probs = pad_responses(logprobs_from_logits(logits, responses[:, :kept]), responses.shape[1])
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
        entropy = pad_responses(entropy, responses.shape[1])
    teacher_log_probs = micro.batch[keys.TEACHER_TOPK_LOG_PROBS][:, :kept]
    teacher_ids = micro.batch[keys.TEACHER_TOPK_IDS][:, :kept].long()
    per_token = DISTILL_LOSSES.get(config.name)(logits, teacher_log_probs, teacher_ids)  # (b, T_k)
    mask = micro.batch[keys.RESPONSE_MASK].float()
    loss = agg_loss(pad_responses(per_token, responses.shape[1]), mask, loss_agg_mode, *info)
    metrics = {
        "actor/distill_loss": float(loss.detach()),
        "actor/distill_teacher_topk_mass": float(teacher_mass(teacher_log_probs, mask[:, :kept])),
    }
    return log_probs, entropy, float(config.loss_coef) * loss, metrics
