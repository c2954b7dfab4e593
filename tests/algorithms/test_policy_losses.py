"""Policy losses against hand-derived values (arithmetic in the comments) and gradients."""

import dataclasses
import math

import pytest
import torch

from hybridflow.algorithms import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInputs,
    compute_policy_loss,
)

D = torch.float64
E = math.e


def t(rows, grad=False):
    return torch.tensor(rows, dtype=D, requires_grad=grad)


def run(name, log_ratio, adv, mask=None, config=None, log_prob=None, weights=None):
    """Loss with old_log_prob = log_prob - log_ratio; returns (output, log_prob leaf)."""
    log_prob = t(
        log_prob if log_prob is not None else [[0.0] * len(log_ratio[0])] * len(log_ratio), grad=True
    )
    old = (log_prob - t(log_ratio)).detach()
    mask = t(mask) if mask is not None else torch.ones_like(old)
    inputs = PolicyLossInputs(old, log_prob, t(adv), mask, None if weights is None else t(weights))
    config = dataclasses.replace(config or PolicyLossConfig(), loss_mode=name)
    return compute_policy_loss(inputs, config), log_prob


def metric(out, key):
    return float(out.metrics[key])


# ----------------------------------------------------------------------------- vanilla PPO


def test_vanilla_unclipped_token_mean():
    # ratio = e^0.1 = 1.10517 inside [0.8, 1.2]; A = [1, -2] -> losses [-1.10517, 2 * 1.10517]; mean 0.552585
    r = math.exp(0.1)
    out, log_prob = run("vanilla", [[0.1, 0.1]], [[1.0, -2.0]])
    assert out.pg_loss.item() == pytest.approx((-r + 2 * r) / 2)
    assert metric(out, "actor/pg_clipfrac") == 0.0
    assert metric(out, "actor/ppo_kl") == pytest.approx(-0.1)  # mean(old - new)
    out.pg_loss.backward()
    # d(-A r)/d log_prob = -A r, halved by token-mean
    torch.testing.assert_close(log_prob.grad, t([[-r / 2, 2 * r / 2]]))


def test_vanilla_clip_higher_asymmetric_bounds():
    # ratio e^0.25 = 1.28403, A = +1. Symmetric eps 0.2: clipped to 1.2 -> loss max(-1.284, -1.2) = -1.2.
    # DAPO clip-higher eps_high 0.28: clipped to 1.28 -> -1.28. Both count as clipped.
    sym, _ = run("vanilla", [[0.25]], [[1.0]])
    asym, log_prob = run(
        "vanilla", [[0.25]], [[1.0]], config=PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    )
    assert sym.pg_loss.item() == pytest.approx(-1.2)
    assert asym.pg_loss.item() == pytest.approx(-1.28)
    assert metric(asym, "actor/pg_clipfrac") == 1.0
    asym.pg_loss.backward()
    assert log_prob.grad.item() == 0.0  # the clipped branch carries no gradient


def test_vanilla_lower_bound_uses_clip_ratio_low():
    # ratio e^-0.3 = 0.74082, A = -1: unclipped 0.74082, clipped -(-1) * clamp(0.74, 1 - eps_low) .
    # eps_low 0.2 -> 0.8 (clipped wins); eps_low 0.3 -> 0.74082 is inside [0.7, ...] (no clip).
    out_02, _ = run("vanilla", [[-0.3]], [[-1.0]], config=PolicyLossConfig(clip_ratio_low=0.2))
    out_03, _ = run("vanilla", [[-0.3]], [[-1.0]], config=PolicyLossConfig(clip_ratio_low=0.3))
    assert out_02.pg_loss.item() == pytest.approx(0.8)
    assert metric(out_02, "actor/pg_clipfrac") == 1.0
    assert out_03.pg_loss.item() == pytest.approx(math.exp(-0.3))
    assert metric(out_03, "actor/pg_clipfrac") == 0.0


def test_vanilla_dual_clip_active():
    # ratio = 5 (log 5), A = -1: PPO loss max(5, 1.2) = 5; dual-clip bound -A c = 3 -> min(5, 3) = 3.
    # Second token ratio 1, A = -1: loss 1, no dual clip. token-mean = (3 + 1) / 2 = 2.
    out, log_prob = run("vanilla", [[math.log(5.0), 0.0]], [[-1.0, -1.0]])
    assert out.pg_loss.item() == pytest.approx(2.0)
    assert metric(out, "actor/pg_clipfrac_lower") == pytest.approx(0.5)
    out.pg_loss.backward()
    # the dual-clipped token has a constant loss: zero gradient; the other: -A r / 2 = 0.5
    torch.testing.assert_close(log_prob.grad, t([[0.0, 0.5]]))


def test_vanilla_dual_clip_ignores_positive_advantages():
    # ratio 5, A = +1: clipped loss -1.2 (PPO), dual clip applies only to A < 0
    out, _ = run("vanilla", [[math.log(5.0)]], [[1.0]])
    assert out.pg_loss.item() == pytest.approx(-1.2)
    assert metric(out, "actor/pg_clipfrac_lower") == 0.0


def test_vanilla_mask_rollout_weights_and_agg_mode():
    # ratios 1; losses -A = [-1, -2 | -3, (-4 masked)]; IS weights [0.5, 1 | 2, 9]
    # weighted: [-0.5, -2 | -6]; seq-mean-token-sum = ((-2.5) + (-6)) / 2 = -4.25
    config = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum")
    out, _ = run(
        "vanilla",
        [[0.0, 0.0], [0.0, 0.0]],
        [[1.0, 2.0], [3.0, 4.0]],
        mask=[[1, 1], [1, 0]],
        config=config,
        weights=[[0.5, 1.0], [2.0, 9.0]],
    )
    assert out.pg_loss.item() == pytest.approx(-4.25)


def test_log_ratio_is_clamped_before_exp():
    # log ratio 100 is clamped to 20: ratio e^20 (finite); A = -1 -> dual clip 3
    out, _ = run("vanilla", [[100.0]], [[-1.0]])
    assert out.pg_loss.item() == pytest.approx(3.0)
    out_gpg, _ = run("cispo", [[100.0]], [[1.0]], log_prob=[[-1.0]])
    assert torch.isfinite(out_gpg.pg_loss)


def test_clip_ratio_c_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=1.0)


# ----------------------------------------------------------------------------- gspo, gpg, cispo, sapo


def test_gspo_sequence_ratio_value_and_gradient():
    # token log ratios [0.1, -0.3] -> sequence ratio s = e^(-0.1) = 0.904837 (inside [0.8, 1.2]); A = 1:
    # loss per token -s, seq-mean-token-mean -> -s; d/d log_prob_t = -A s / |y| = -s / 2
    s = math.exp(-0.1)
    out, log_prob = run("gspo", [[0.1, -0.3]], [[1.0, 1.0]], log_prob=[[-1.0, -2.0]])
    assert out.pg_loss.item() == pytest.approx(-s)
    assert metric(out, "actor/ppo_kl") == pytest.approx(0.1)  # mean(-0.1, 0.3)
    out.pg_loss.backward()
    torch.testing.assert_close(log_prob.grad, t([[-s / 2, -s / 2]]))


def test_gspo_clips_whole_sequence():
    # two sequences: log ratios mean 0.5 -> s = e^0.5 = 1.6487 > 1.2 -> clipped to 1.2, A = 1: loss -1.2;
    # second sequence (2 valid tokens of 3) ratio 1, A = -1: loss 1. Mean over sequences: (-1.2 + 1) / 2
    out, _ = run(
        "gspo", [[0.5, 0.5, 0.5], [0.0, 0.0, 7.0]], [[1.0] * 3, [-1.0] * 3], mask=[[1, 1, 1], [1, 1, 0]]
    )
    assert out.pg_loss.item() == pytest.approx(-0.1)
    assert metric(out, "actor/pg_clipfrac") == pytest.approx(3 / 5)


def test_gpg_loss():
    # -A log pi: log pi [-1, -2], A [1, -1] -> [1, -2], token-mean -0.5
    out, log_prob = run("gpg", [[0.0, 0.0]], [[1.0, -1.0]], log_prob=[[-1.0, -2.0]])
    assert out.pg_loss.item() == pytest.approx(-0.5)
    out.pg_loss.backward()
    torch.testing.assert_close(log_prob.grad, t([[-0.5, 0.5]]))


def test_cispo_clips_weight_but_keeps_gradient():
    # token 0: ratio e^0.5 = 1.6487 -> weight clip to 1.2; token 1: ratio e^-0.1 = 0.904837 (unclipped)
    # loss = -w A log pi with log pi = [-1, -2], A = [1, 1]: [1.2, 2 * 0.904837], token-mean
    w1 = math.exp(-0.1)
    out, log_prob = run("cispo", [[0.5, -0.1]], [[1.0, 1.0]], log_prob=[[-1.0, -2.0]])
    assert out.pg_loss.item() == pytest.approx((1.2 + 2 * w1) / 2)
    assert metric(out, "actor/pg_clipfrac") == pytest.approx(0.5)
    out.pg_loss.backward()
    # gradient flows only through log pi: -w A / 2, non-zero even for the clipped token
    torch.testing.assert_close(log_prob.grad, t([[-1.2 / 2, -w1 / 2]]))


def test_sapo_gate_at_ratio_one():
    # r = 1: gate = sigmoid(0) * 4 / tau = 2 / tau. A = +1 uses tau_pos = 1 -> loss -2;
    # A = -1 uses tau_neg = 1.05 -> loss 2 / 1.05. seq-mean-token-mean of one sequence: (-2 + 1.904762) / 2
    out, log_prob = run("sapo", [[0.0, 0.0]], [[1.0, -1.0]])
    assert out.pg_loss.item() == pytest.approx((-2 + 2 / 1.05) / 2)
    out.pg_loss.backward()
    # d gate / d r at r = 1 is (4 / tau) * tau * 1/4 = 1, and dr/dlog_prob = r = 1 -> grad -A / 2
    torch.testing.assert_close(log_prob.grad, t([[-0.5, 0.5]]))


def test_sapo_gate_away_from_one():
    # r = e^0.5, A = 1, tau 1: gate = 4 sigmoid(e^0.5 - 1) = 4 / (1 + e^-(0.648721))
    gate = 4 / (1 + math.exp(-(math.exp(0.5) - 1)))
    out, _ = run("sapo", [[0.5]], [[1.0]], config=PolicyLossConfig(tau_pos=1.0))
    assert out.pg_loss.item() == pytest.approx(-gate)


# ----------------------------------------------------------------------------- clip_cov and kl_cov


def test_clip_cov_detaches_the_high_covariance_token():
    # A = [2, -2, 0, 0] (mean 0), log pi = [0, -1, -1, -2] (mean -1): cov = [2, 0, 0, 0]; only token 0 lies
    # in (lb 1, ub 5) and max(1, int(0.0002 * 4)) = 1 token is clipped. ratio 1: losses -A = [-2, 2, 0, 0]
    # -> [0, 2, 0, 0]; token-mean 0.5
    out, log_prob = run("clip_cov", [[0.0] * 4], [[2.0, -2.0, 0.0, 0.0]], log_prob=[[0.0, -1.0, -1.0, -2.0]])
    assert out.pg_loss.item() == pytest.approx(0.5)
    assert metric(out, "actor/pg_clipfrac") == pytest.approx(0.25)
    out.pg_loss.backward()
    torch.testing.assert_close(log_prob.grad, t([[0.0, 0.5, 0.0, 0.0]]))


def test_clip_cov_skips_tokens_already_clipped_by_ppo():
    # token 0 now has ratio e^0.5 (clipped by PPO at 1.2 since A > 0): no candidate remains, plain PPO
    # losses [-2 * 1.2, 2, 0, 0] -> token-mean -0.1
    out, _ = run(
        "clip_cov", [[0.5, 0.0, 0.0, 0.0]], [[2.0, -2.0, 0.0, 0.0]], log_prob=[[0.0, -1.0, -1.0, -2.0]]
    )
    assert out.pg_loss.item() == pytest.approx(-0.1)
    assert metric(out, "actor/pg_clipfrac") == 0.0


def test_kl_cov_penalises_top_covariance_token():
    # same cov = [2, 0, 0, 0] -> token 0 (top-1) gets + ppo_kl_coef |log r|. log r = [0.1, 0, 0, 0]:
    # losses [-2 e^0.1 + 0.1 * 0.1, 2, 0, 0]; token-mean
    r = math.exp(0.1)
    out, _ = run(
        "kl_cov", [[0.1, 0.0, 0.0, 0.0]], [[2.0, -2.0, 0.0, 0.0]], log_prob=[[0.0, -1.0, -1.0, -2.0]]
    )
    assert out.pg_loss.item() == pytest.approx((-2 * r + 0.01 + 2) / 4)
    assert metric(out, "actor/pg_clipfrac") == pytest.approx(0.25)


def test_kl_cov_does_not_clip():
    # a single token with ratio e^0.5 and A = 1: unclipped -e^0.5 plus 0.1 * 0.5 penalty (top-1 token)
    out, _ = run("kl_cov", [[0.5]], [[1.0]])
    assert out.pg_loss.item() == pytest.approx(-math.exp(0.5) + 0.05)


# ----------------------------------------------------------------------------- shared behaviour


# bypass_mode needs the rollout-correction settings and reports its own metrics (test_rollout_correction.py)
@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES.names() if n != "bypass_mode"])
def test_every_loss_reports_standard_metrics_and_survives_full_mask(name):
    out, log_prob = run(name, [[0.1, -0.2], [0.3, 0.0]], [[1.0, -1.0], [0.5, 2.0]], mask=[[0, 0], [0, 0]])
    assert set(out.metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert out.pg_loss.item() == 0.0
    out.pg_loss.backward()
    assert torch.isfinite(log_prob.grad).all()


def test_compute_policy_loss_dispatches_on_loss_mode():
    inputs = PolicyLossInputs(t([[0.0]]), t([[-1.0]], grad=True), t([[2.0]]), t([[1.0]]))
    out = compute_policy_loss(inputs, PolicyLossConfig(loss_mode="gpg"))
    assert out.pg_loss.item() == pytest.approx(2.0)  # -A log pi = -2 * -1
