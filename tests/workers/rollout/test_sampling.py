"""Token choice: the inverse-CDF sampler's distribution, top-k/top-p masks, reported log-probs."""

import math

import pytest
import torch

from hybridflow.workers.rollout.engine.sampling import (
    SamplingParams,
    _top_k_top_p,
    choose_tokens,
    sample_from_probs,
)


def test_inverse_cdf_sampler_draws_the_softmax_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = torch.log(probs).unsqueeze(0).expand(20000, 4).contiguous()
    draws = sample_from_probs(torch.softmax(logits, dim=-1), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert freq[1] == 0  # a zero-probability token is never drawn
    for p, f in zip(probs.tolist(), freq.tolist(), strict=True):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / draws.numel()) + 1e-12


def test_top_k_and_top_p_masks_by_hand():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.25, 0.2]]))
    top2 = _top_k_top_p(logits, top_k=2, top_p=1.0)
    assert torch.isinf(top2).tolist() == [[True, False, False, True]]
    # nucleus 0.7: 0.5 (mass before 0) and 0.25 (mass before 0.5) stay; 0.2 (mass before 0.75) goes
    nucleus = _top_k_top_p(logits, top_k=-1, top_p=0.7)
    assert torch.isinf(nucleus).tolist() == [[True, False, False, True]]
    # the best token always stays, however small top_p is
    assert torch.isinf(_top_k_top_p(logits, -1, 1e-6)).tolist() == [[True, False, True, True]]


def test_reported_log_prob_is_over_the_full_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.5, top_k=2)
    tokens, log_probs = choose_tokens(logits, params, torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits / 0.5, dim=-1)[0, tokens[0]]
    assert tokens.item() in (0, 1)
    assert log_probs.item() == pytest.approx(expected.item(), abs=1e-6)


def test_greedy_reports_untempered_log_probs():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    tokens, log_probs = choose_tokens(logits, SamplingParams(do_sample=False), None)
    assert tokens.tolist() == [1]
    assert log_probs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item(), abs=1e-6)
