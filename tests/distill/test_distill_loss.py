"""The top-k distillation loss (verl's ``kl``): hand-derived values, the dense limit, its gradient."""

import math

import pytest
import torch

from hybridflow.algorithms import DISTILL_LOSSES, agg_loss
from hybridflow.algorithms.distillation import distill_config_problems, teacher_mass, topk_forward_kl


def test_hand_derived_value():
    # student logits [0, ln 2, ln 3] -> Q = [1/6, 2/6, 3/6]; teacher top-2: ids [2, 1], P = [0.6, 0.3]
    logits = torch.tensor([[[0.0, math.log(2), math.log(3)]]], dtype=torch.float64)
    ids = torch.tensor([[[2, 1]]])
    log_p = torch.tensor([[[math.log(0.6), math.log(0.3)]]], dtype=torch.float64)
    want = 0.6 * (math.log(0.6) - math.log(0.5)) + 0.3 * (math.log(0.3) - math.log(1 / 3))
    loss = DISTILL_LOSSES.get("kl")(logits, log_p, ids)
    assert loss.shape == (1, 1)
    assert abs(float(loss) - want) < 1e-12
    # no renormalisation, no tail term: the value is not the KL of the renormalised top-k
    renormalised = 2 / 3 * math.log((2 / 3) / 0.5) + 1 / 3 * math.log((1 / 3) / (1 / 3))
    assert abs(float(loss) - renormalised) > 1e-3


def test_full_vocabulary_top_k_equals_dense_kl():
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(2, 5, 11, generator=generator, dtype=torch.float64)
    teacher = torch.randn(2, 5, 11, generator=generator, dtype=torch.float64)
    log_p = torch.log_softmax(teacher, dim=-1)
    top_log_p, top_ids = log_p.topk(11, dim=-1)  # k = V, in descending order (a permutation)
    loss = topk_forward_kl(student, top_log_p, top_ids)
    dense = torch.nn.functional.kl_div(
        torch.log_softmax(student, dim=-1), log_p, log_target=True, reduction="none"
    ).sum(-1)
    torch.testing.assert_close(loss, dense, atol=1e-12, rtol=0)


@pytest.mark.parametrize("k", [3, 11])
def test_gradient_is_the_sparse_objectives(k):
    """d l / d z_j = S Q_j - P_sparse_j (S = sum_k P_k), autograd's on the same sparse objective;
    verl's hand-written Q - P_sparse equals it only when S = 1 (k = V)."""
    generator = torch.Generator().manual_seed(1)
    student = torch.randn(3, 4, 11, generator=generator, dtype=torch.float64, requires_grad=True)
    log_p = torch.log_softmax(torch.randn(3, 4, 11, generator=generator, dtype=torch.float64), dim=-1)
    top_log_p, top_ids = log_p.topk(k, dim=-1)
    topk_forward_kl(student, top_log_p, top_ids).sum().backward()
    q = torch.softmax(student.detach(), dim=-1)
    p_sparse = torch.zeros_like(q).scatter(-1, top_ids, top_log_p.exp())
    s = p_sparse.sum(-1, keepdim=True)
    torch.testing.assert_close(student.grad, s * q - p_sparse, atol=1e-12, rtol=0)
    # the same objective written independently, differentiated by autograd
    again = student.detach().clone().requires_grad_(True)
    log_q = torch.log_softmax(again, dim=-1)
    (p_sparse * (torch.where(p_sparse > 0, p_sparse.log(), 0.0) - log_q)).sum().backward()
    torch.testing.assert_close(student.grad, again.grad, atol=1e-12, rtol=0)
    verl_backward = q - p_sparse
    if k == 11:
        torch.testing.assert_close(student.grad, verl_backward, atol=1e-12, rtol=0)
    else:  # the difference is (1 - S) Q
        torch.testing.assert_close(verl_backward - student.grad, (1 - s) * q, atol=1e-12, rtol=0)
        assert float((1 - s).min()) > 1e-3


def test_token_mean_through_the_loss_agg_modes():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert abs(float(agg_loss(per_token, mask, "token-mean")) - 7 / 3) < 1e-6
    log_p = torch.log(torch.tensor([[[0.5, 0.25]], [[0.9, 0.05]]]))
    assert abs(float(teacher_mass(log_p, torch.ones(2, 1))) - (0.75 + 0.95) / 2) < 1e-6


def test_config_refusals():
    assert distill_config_problems({"name": "kl", "loss_coef": 0.5}) == []
    assert "not implemented" in distill_config_problems({"name": "jsd"})[0]
    assert "registered: ['kl']" in distill_config_problems({"name": "nope"})[0]
    assert ">= 0" in distill_config_problems({"loss_coef": -1})[0]
