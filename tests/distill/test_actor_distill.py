"""The actor's distillation term: its gradient is the sparse objective's on the actor's own forward,
pure distillation ignores the advantages, and mixing adds the policy loss by the weight."""

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from hybridflow import keys
from hybridflow.algorithms import agg_loss
from hybridflow.algorithms.distillation import topk_forward_kl
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
from hybridflow.workers.fsdp_utils import build_device_mesh
from hybridflow.workers.model_builder import build_fsdp_module
from tests.utils.checkpoint.fsdp_toy import full_value, gloo_group
from tests.workers.test_loss_normalisation import PROMPT_LEN, RESPONSE_LEN, _actor_config, _batch

K = 4


def _with_teacher(data, vocab: int, advantage_scale: float = 1.0):
    generator = torch.Generator().manual_seed(3)
    teacher = torch.log_softmax(torch.randn(4, RESPONSE_LEN, vocab, generator=generator), dim=-1)
    top_log_probs, top_ids = teacher.topk(K, dim=-1)
    data.batch[keys.TEACHER_TOPK_LOG_PROBS] = top_log_probs
    data.batch[keys.TEACHER_TOPK_IDS] = top_ids
    data.batch[keys.ADVANTAGES] = data.batch[keys.ADVANTAGES] * advantage_scale
    return data


def _grads(model_dir: str, distill: dict | None, advantage_scale: float = 1.0):
    config = _actor_config("token-mean", 4, 2)
    if distill is not None:
        config.distill_loss = OmegaConf.create(distill)
    module = build_fsdp_module(
        OmegaConf.create({"path": model_dir}), OmegaConf.create({}), build_device_mesh(1, "cpu")
    )
    actor = DataParallelPPOActor(config, module, torch.optim.SGD(module.parameters(), lr=0.0), RESPONSE_LEN)
    vocab = module.config.vocab_size
    data = _with_teacher(_batch(), vocab, advantage_scale)
    if distill is None:  # the plain policy loss on the same batch (no teacher keys)
        data.pop(batch_keys=[keys.TEACHER_TOPK_LOG_PROBS, keys.TEACHER_TOPK_IDS])
    actor.module.train()
    metrics: dict[str, list] = {}
    actor.accumulate_gradients(data, 1.0, metrics)
    grads = {n: full_value(p.grad).clone() for n, p in actor.module.named_parameters() if p.grad is not None}
    return grads, metrics, data


def _reference_grads(model_dir: str, data) -> tuple[dict[str, torch.Tensor], float]:
    """token-mean of the top-k KL over the response mask, by autograd on a plain HF forward."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(
        input_ids=data.batch[keys.INPUT_IDS],
        attention_mask=data.batch[keys.ATTENTION_MASK],
        position_ids=data.batch[keys.POSITION_IDS],
    ).logits[:, PROMPT_LEN - 1 : -1]
    per_token = topk_forward_kl(
        logits, data.batch[keys.TEACHER_TOPK_LOG_PROBS], data.batch[keys.TEACHER_TOPK_IDS]
    )
    loss = agg_loss(per_token, data.batch[keys.RESPONSE_MASK].float(), "token-mean")
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, float(loss.detach())


def test_pure_distillation_gradient_is_the_sparse_objectives(tiny_model_dir):
    with gloo_group():
        got, metrics, data = _grads(tiny_model_dir, {"name": "kl", "loss_coef": 1.0})
        flipped, _, _ = _grads(tiny_model_dir, {"name": "kl", "loss_coef": 1.0}, advantage_scale=-3.0)
    want, loss = _reference_grads(tiny_model_dir, data)
    assert abs(metrics["actor/distill_loss"][0] - loss) < 1e-5
    assert 0 < metrics["actor/distill_teacher_topk_mass"][0] < 1  # k = 4 of the vocabulary
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(flipped[name], got[name], rtol=0, atol=0, msg=name)  # no advantages


def test_mixing_adds_the_policy_loss_by_the_weight(tiny_model_dir):
    with gloo_group():
        pure, _, _ = _grads(tiny_model_dir, {"name": "kl", "loss_coef": 1.0})
        policy, _, _ = _grads(tiny_model_dir, None)
        mixed, metrics, _ = _grads(tiny_model_dir, {"name": "kl", "loss_coef": 0.5, "use_policy_loss": True})
    assert "actor/pg_loss" in metrics and "actor/distill_loss" in metrics
    for name, grad in mixed.items():
        torch.testing.assert_close(grad, policy[name] + 0.5 * pure[name], rtol=1e-4, atol=1e-6, msg=name)
