"""On-policy distillation losses: the student matches a teacher's top-k next-token distribution.

The student generates; a teacher (served: :mod:`hybridflow.serve.scoring`) returns, at every response
position t, its k most likely tokens ``ids_t,k`` with log-probs ``log P_t,k``. The student's log-probs
``log Q_t(v) = log_softmax(z_t)(v)`` over its whole vocabulary are read at those ids. verl's on-policy
distillation recipe (``recipe/gkd``, ``actor.distill_loss.name=kl``) minimises per token::

    l_t = sum_k P_t,k (log P_t,k - log Q_t(ids_t,k))          # KL(P_topk || Q) on the teacher's top-k

on the teacher's *raw* top-k: no renormalisation of P over the k ids and no term for the tail mass
``1 - sum_k P_t,k``. The per-token loss is then aggregated with the actor's ``loss_agg_mode``
(:mod:`.loss_agg`; verl's recipe: token-mean).

**The caveat when sum_k P_k < 1.** With ``S = sum_k P_k``, the true gradient of ``l`` in the student's
logits is ``dl/dz_j = S Q_j - P_sparse_j`` (P_sparse: P at the top-k ids, 0 elsewhere). verl's hand-written
backward returns ``Q_j - P_sparse_j``, which is that gradient only when S = 1 (k = the whole vocabulary,
or a teacher certain within its top k); otherwise it adds ``(1 - S) Q``, a pull of every logit towards
the student's own distribution that the objective does not contain. Here the loss is differentiated by
autograd: the gradient is exactly that of the objective above. At a fixed point of this objective
``Q_k = P_k / S`` on the top-k: the student learns the teacher's top-k *renormalised*, and puts no mass
outside it (the tail's ``(1 - S)`` is not asked for).

Shapes: b rows, T response positions, V the vocabulary, k the teacher's top-k.
Every loss is ``fn(student_logits (b, T, V), teacher_log_probs (b, T, k), teacher_ids (b, T, k)) ->
(b, T)`` per-token losses; positions outside the response mask may hold anything finite.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.utils.registry import Registry

DistillLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

DISTILL_LOSSES: Registry[DistillLossFn] = Registry("distillation loss")

# verl's recipe also names rkl, kl_rkl and jsd (renormalised top-k variants); they are refused here
VERL_DISTILL_LOSSES_NOT_HERE = ("rkl", "kl_rkl", "jsd")


@DISTILL_LOSSES.register("kl")
def topk_forward_kl(
    student_logits: torch.Tensor, teacher_log_probs: torch.Tensor, teacher_ids: torch.Tensor
) -> torch.Tensor:
    """``sum_k P_k (log P_k - log Q(ids_k))`` per token (b, T): verl's ``kl`` (module docstring)."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # fp32 at least (bf16 logits)
    student_log_probs = torch.log_softmax(student_logits.to(dtype), dim=-1).gather(-1, teacher_ids)
    teacher_log_probs = teacher_log_probs.to(dtype)
    return (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(dim=-1)


@dataclass(frozen=True)
class DistillConfig:
    """``actor_rollout_ref.actor.distill_loss``: ``name`` (a registered loss), ``loss_coef`` (its
    weight in the actor's loss), ``use_policy_loss`` (also the PPO/GRPO policy loss; false: pure
    distillation, the policy loss is not computed into the gradient)."""

    name: str = "kl"
    loss_coef: float = 1.0
    use_policy_loss: bool = False

    @classmethod
    def from_config(cls, section) -> DistillConfig:
        section = section or {}
        return cls(
            name=str(section.get("name", "kl")),
            loss_coef=float(section.get("loss_coef", 1.0)),
            use_policy_loss=bool(section.get("use_policy_loss", False)),
        )


def distill_config_problems(section) -> list[str]:
    """What is wrong with an ``actor.distill_loss`` section (checked before Ray starts)."""
    config = DistillConfig.from_config(section)
    problems = []
    if config.name in VERL_DISTILL_LOSSES_NOT_HERE:
        problems.append(
            f"actor_rollout_ref.actor.distill_loss.name={config.name!r} (verl's renormalised top-k "
            f"variant) is not implemented; use one of {sorted(DISTILL_LOSSES)}"
        )
    elif config.name not in DISTILL_LOSSES:
        problems.append(
            f"actor_rollout_ref.actor.distill_loss.name={config.name!r} is not a distillation loss; "
            f"registered: {sorted(DISTILL_LOSSES)}"
        )
    if config.loss_coef < 0:
        problems.append(
            f"actor_rollout_ref.actor.distill_loss.loss_coef must be >= 0, got {config.loss_coef}"
        )
    return problems


def teacher_mass(teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the masked positions of ``S = sum_k P_k`` (how much of the teacher the top-k holds:
    the caveat above matters when it is well below 1)."""
    mass = teacher_log_probs.float().exp().sum(dim=-1)
    return (mass * mask).sum() / mask.sum().clamp(min=1)
