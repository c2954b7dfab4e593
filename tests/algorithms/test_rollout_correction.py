"""Rollout correction (verl's ``algorithm.rollout_correction``) against hand-derived numbers.

Two sequences, log π_train − log π_rollout:  row 0 = [0, log 2, log 4] (3 tokens),
row 1 = [log 1/2, 0, ·] (2 tokens, the third is padding)."""

import math

import pytest
import torch

from hybridflow.algorithms.rollout_correction import (
    RolloutCorrection,
    bypass_policy_loss,
    correct,
    is_weights,
    rejection_mask,
    rs_thresholds,
)

LOG_RATIO = torch.tensor([[0.0, math.log(2), math.log(4)], [math.log(0.5), 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_weights_are_truncated_and_zero_at_padding():
    weights, metrics = is_weights(LOG_RATIO, MASK, "token", threshold=2.0)
    assert weights.flatten().tolist() == pytest.approx([1.0, 2.0, 2.0, 0.5, 1.0, 0.0])
    # statistics of the weights before truncation: 1, 2, 4, 1/2, 1
    assert metrics["rollout_is_mean"] == pytest.approx(8.5 / 5)
    assert metrics["rollout_is_max"] == pytest.approx(4.0) and metrics["rollout_is_min"] == pytest.approx(0.5)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # only 4 > 2
    assert metrics["rollout_is_ratio_fraction_low"] == 0.0  # 1/2 is not below 1/2
    # ESS of the weights bounded to [1/2, 2]: 1, 2, 2, 1/2, 1 -> mean 1.3, ESS = 1 / mean((w / 1.3)^2)
    bounded = torch.tensor([1.0, 2.0, 2.0, 0.5, 1.0])
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx(
        1 / float(((bounded / 1.3) ** 2).mean()), rel=1e-6
    )


def test_sequence_weights_are_the_product_of_the_tokens():
    weights, metrics = is_weights(LOG_RATIO, MASK, "sequence", threshold=2.0)
    # row 0: 1 x 2 x 4 = 8 -> 2; row 1: 1/2 x 1 = 1/2
    assert weights.flatten().tolist() == pytest.approx([2.0, 2.0, 2.0, 0.5, 0.5, 0.0])
    assert metrics["rollout_is_max"] == pytest.approx(8.0) and metrics["rollout_is_min"] == pytest.approx(0.5)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # one sequence of two


def test_batch_normalized_weights_average_one():
    weights, metrics = is_weights(LOG_RATIO, MASK, "token", threshold=2.0, batch_normalize=True)
    # truncated 1, 2, 2, 1/2, 1 have mean 1.3
    assert metrics["rollout_is_batch_norm_factor"] == pytest.approx(1.3)
    assert (weights * MASK).sum() / MASK.sum() == pytest.approx(1.0)


def test_token_k1_rejects_ratios_outside_the_bounds():
    # k1 = -log ratio, kept within [log 1/2, log 2]: log 4 gives -1.386 < -0.693 -> rejected
    mask, metrics = rejection_mask(LOG_RATIO, MASK, "token_k1", 2.0)
    assert mask.tolist() == [[1, 1, 0], [1, 1, 0]]
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)


def test_seq_sum_k3_rejects_a_whole_sequence():
    # k3 = e^r - 1 - r: row 0 sums 0 + (2 - 1 - ln 2) + (4 - 1 - ln 4) = 1.921 > 1,
    # row 1 sums (1/2 - 1 + ln 2) + 0 = 0.193
    mask, metrics = rejection_mask(LOG_RATIO, MASK, "seq_sum_k3", 1.0)
    assert mask.tolist() == [[0, 0, 0], [1, 1, 0]]
    assert metrics["rollout_rs_seq_sum_k3_mean"] == pytest.approx((3 * 1.9205 + 2 * 0.1931) / 5, rel=1e-3)
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)


def test_several_options_must_all_pass_and_thresholds_parse():
    mask, _ = rejection_mask(LOG_RATIO, MASK, "token_k1,seq_sum_k3", "0.4_3.0,1.0")
    assert mask.tolist() == [
        [0, 0, 0],
        [1, 1, 0],
    ]  # row 0 fails the sum; token bounds 0.4..3 keep log 4? no: row 0 is out anyway
    assert rs_thresholds(["token_k1"], 2.0) == {"token_k1": (0.5, 2.0)}
    assert rs_thresholds(["token_k1", "seq_max_k2"], "0.1_1.2,0.5") == {
        "token_k1": (0.1, 1.2),
        "seq_max_k2": (None, 0.5),
    }
    with pytest.raises(ValueError, match="unknown option"):
        rejection_mask(LOG_RATIO, MASK, "token_k9", 2.0)
    with pytest.raises(ValueError, match="one upper bound"):
        rs_thresholds(["seq_mean_k3"], "0.1_0.2")


def test_off_policy_gap_metrics():
    train = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -1.0, 0.0]], dtype=torch.float64)
    rollout = train - LOG_RATIO
    _, _, metrics = correct(train, rollout, MASK, RolloutCorrection(rollout_is="token"))
    # kl = mean(log pi_rollout - log pi_train) = -mean(log ratio) = -(ln 2 + ln 4 - ln 2) / 5
    assert metrics["rollout_corr/kl"] == pytest.approx(-math.log(4) / 5)
    assert metrics["rollout_corr/training_ppl"] == pytest.approx((math.exp(1) + math.exp(1.5)) / 2)
    assert all(key.startswith("rollout_corr/") for key in metrics)
    assert "rollout_corr/rollout_is_eff_sample_size" in metrics


def test_bypass_reinforce_weights_the_policy_gradient_by_the_current_over_the_rollout_policy():
    log_prob = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    rollout = torch.tensor([[math.log(0.25), math.log(0.25)]])  # w = 2 (truncated to 1.5), 1
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    config = {
        "policy_loss": {
            "loss_mode": "bypass_mode",
            "rollout_correction": {
                "rollout_is": "token",
                "rollout_is_threshold": 1.5,
                "bypass_mode": True,
                "loss_type": "reinforce",
            },
        }
    }
    loss, metrics = bypass_policy_loss(rollout, log_prob, advantages, mask, "token-mean", config)
    # token-mean of -w A log pi = -(1.5 * ln 0.5 - 1 * ln 0.25) / 2
    assert float(loss) == pytest.approx(-(1.5 * math.log(0.5) - math.log(0.25)) / 2)
    loss.backward()
    assert log_prob.grad.flatten().tolist() == pytest.approx(
        [-1.5 / 2, 1.0 / 2]
    )  # the weights carry no gradient
    assert float(metrics["rollout_corr/rollout_is_max"]) == pytest.approx(2.0)


def test_bypass_ppo_clip_is_the_clipped_ratio_against_the_rollout_policy():
    from hybridflow.algorithms.policy_loss import PolicyLossConfig, PolicyLossInputs, vanilla_policy_loss

    log_prob = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    rollout = torch.tensor([[math.log(0.25), math.log(0.25)]])
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    config = {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"bypass_mode": True}}}
    loss, _ = bypass_policy_loss(rollout, log_prob, advantages, mask, "token-mean", config)
    expected, _ = vanilla_policy_loss(
        PolicyLossInputs(rollout, log_prob, advantages, mask), PolicyLossConfig()
    )
    assert float(loss) == pytest.approx(float(expected))  # no IS weights on top of the ratio
