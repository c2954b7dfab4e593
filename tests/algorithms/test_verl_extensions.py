"""A verl user's extension code runs unchanged: verl's registration decorators, call signatures and
return shapes, imported from the verl-mirrored path. Expected numbers are derived by hand."""

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.algorithms import ADV_ESTIMATORS, POLICY_LOSSES, AdvantageInputs, PolicyLossInputs
from hybridflow.algorithms import compute_advantage as dispatch_advantage
from hybridflow.algorithms import compute_policy_loss as dispatch_policy_loss
from hybridflow.trainer.ppo import core_algos
from hybridflow.trainer.ppo.core_algos import (
    AdvantageEstimator,
    agg_loss,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)

D = torch.float64


def actor_section(**overrides):
    """An ``actor_rollout_ref.actor``-shaped DictConfig, as the worker hands it to the losses."""
    base = {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "loss_scale_factor": None,
        "entropy_coeff": 0.0,
        "policy_loss": {"loss_mode": "vanilla", "my_margin": 0.5},
    }
    base.update(overrides)
    return OmegaConf.create(base)


@pytest.fixture
def scratch_registries(monkeypatch):
    monkeypatch.setattr(POLICY_LOSSES, "_entries", dict(POLICY_LOSSES._entries))
    monkeypatch.setattr(ADV_ESTIMATORS, "_entries", dict(ADV_ESTIMATORS._entries))


def test_builtin_vanilla_with_verl_keywords_returns_loss_and_metrics():
    # log r = 0.3 -> r = e^0.3 = 1.34986; A = +1 clips at 1 + 0.28 (clip_ratio_high) -> loss -1.28;
    # A = -1: max(1.34986, 1.28) = 1.34986 (no clip; dual bound 3 not hit). token-mean: (-1.28 + 1.34986) / 2
    fn = get_policy_loss_fn("vanilla")
    pg_loss, metrics = fn(
        old_log_prob=torch.zeros(1, 2, dtype=D),
        log_prob=torch.full((1, 2), 0.3, dtype=D),
        advantages=torch.tensor([[1.0, -1.0]], dtype=D),
        response_mask=torch.ones(1, 2, dtype=D),
        loss_agg_mode="token-mean",
        config=actor_section(),
    )
    assert pg_loss.item() == pytest.approx((-1.28 + math.exp(0.3)) / 2)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(0.5)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(-0.3)
    assert core_algos.compute_policy_loss_vanilla is fn


def test_builtin_loss_honours_global_batch_info_from_config():
    cfg = actor_section(global_batch_info={"dp_size": 2, "batch_num_tokens": 8, "global_batch_size": 4})
    pg_loss, _ = get_policy_loss_fn("gpg")(
        old_log_prob=torch.zeros(1, 2, dtype=D),
        log_prob=torch.tensor([[-1.0, -2.0]], dtype=D),
        advantages=torch.ones(1, 2, dtype=D),
        response_mask=torch.ones(1, 2, dtype=D),
        loss_agg_mode="token-mean",
        config=cfg,
    )
    assert pg_loss.item() == pytest.approx((1.0 + 2.0) / 8 * 2)  # local sum / global N * dp_size


def test_user_loss_with_verl_signature_runs_in_the_dispatcher(scratch_registries):
    seen = {}

    @register_policy_loss("margin_pg")
    def margin_pg(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        seen["margin"] = config.policy_loss.my_margin
        seen["clip"] = config.clip_ratio
        seen["entropy_coeff"] = config.get("entropy_coeff")
        losses = -(advantages - config.policy_loss.my_margin) * log_prob
        loss = agg_loss(losses, response_mask, loss_agg_mode, **config.global_batch_info)
        return loss, {"actor/pg_clipfrac": torch.tensor(0.0)}

    cfg = actor_section(policy_loss={"loss_mode": "margin_pg", "my_margin": 0.5})
    log_prob = torch.tensor([[-1.0, -3.0]], dtype=D, requires_grad=True)
    ones = torch.ones(1, 2, dtype=D)
    inputs = PolicyLossInputs(torch.zeros(1, 2, dtype=D), log_prob, ones, ones)
    out = dispatch_policy_loss(inputs, cfg)
    # -(1 - 0.5) * [-1, -3] = [0.5, 1.5] -> token-mean 1.0
    assert out.pg_loss.item() == pytest.approx(1.0)
    assert seen == {"margin": 0.5, "clip": 0.2, "entropy_coeff": 0.0}
    out.pg_loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.25, -0.25]], dtype=D))


def test_user_loss_returning_verl_four_tuple_is_accepted(scratch_registries):
    @register_policy_loss("old_style")
    def old_style(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
        loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode)
        return loss, torch.tensor(0.25), torch.tensor(0.5), torch.tensor(0.0)

    one = torch.ones(1, 1, dtype=D)
    inputs = PolicyLossInputs(torch.zeros(1, 1, dtype=D), torch.tensor([[-2.0]], dtype=D), one, one)
    out = dispatch_policy_loss(inputs, actor_section(policy_loss={"loss_mode": "old_style"}))
    assert out.pg_loss.item() == pytest.approx(2.0)
    assert float(out.metrics["actor/pg_clipfrac"]) == 0.25 and float(out.metrics["actor/ppo_kl"]) == 0.5


def test_adv_estimator_enum_and_verl_signature(scratch_registries):
    assert get_adv_estimator_fn(AdvantageEstimator.GRPO) is get_adv_estimator_fn("grpo")
    # group a scores [1, 0, 1]: mean 2/3, std sqrt(1/3); group b [0.5] is a singleton: mean 0, std 1
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.5, 0.0]], dtype=D)
    mask = torch.ones_like(rewards)
    index = np.array(["a", "a", "a", "b"], dtype=object)
    adv, returns = get_adv_estimator_fn("grpo")(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=True,
        config=None,
    )
    std = math.sqrt(1 / 3)
    e = 1e-6
    divisors = torch.tensor([std + e] * 3 + [1 + e], dtype=D)
    expected = torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.5], dtype=D) / divisors
    torch.testing.assert_close(adv[:, 0], expected)
    torch.testing.assert_close(returns, adv)
    vec, _ = core_algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(vec, adv)
    loo, _ = core_algos.compute_rloo_vectorized_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(loo[:, 0], torch.tensor([0.5, -1.0, 0.5, 0.5], dtype=D))


def test_user_estimator_registered_by_enum_value_gets_config(scratch_registries):
    seen = {}

    @register_adv_est("scaled_outcome")
    def scaled_outcome(token_level_rewards, response_mask, index=None, epsilon=1e-6, config=None, **kwargs):
        seen["gamma"] = config.gamma
        seen["extra"] = sorted(kwargs)
        scores = token_level_rewards.sum(-1, keepdim=True) * config.gamma
        return scores * response_mask, scores * response_mask

    algo = OmegaConf.create({"gamma": 0.5, "lam": 1.0, "norm_adv_by_std_in_grpo": True})
    rewards = torch.tensor([[0.0, 2.0]], dtype=D)
    out = dispatch_advantage(
        "scaled_outcome",
        AdvantageInputs(rewards, torch.ones_like(rewards), index=np.array(["u"]), gamma=0.5, config=algo),
    )
    torch.testing.assert_close(out.advantages, torch.tensor([[1.0, 1.0]], dtype=D))
    assert seen["gamma"] == 0.5
    assert "values" not in seen["extra"]  # None-valued inputs are not passed through **kwargs


def test_taken_enum_name_raises(scratch_registries):
    with pytest.raises(ValueError, match="already registered"):

        @register_adv_est(AdvantageEstimator.REMAX)
        def other(token_level_rewards, response_mask, **kwargs):
            return token_level_rewards, token_level_rewards


def test_compute_entropy_loss_and_kl_controller_from_section():
    logits = torch.zeros(1, 2, 4, dtype=D)  # uniform over 4 -> entropy ln 4 per token
    loss = core_algos.compute_entropy_loss(logits, torch.ones(1, 2, dtype=D), "token-mean")
    assert loss.item() == pytest.approx(math.log(4))
    ctrl = core_algos.get_kl_controller(
        OmegaConf.create({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.2, "horizon": 100})
    )
    ctrl.update(current_kl=0.4, n_steps=10)  # error clipped to 0.2 -> 0.1 * (1 + 0.2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.1 * 1.02)
