import math

import pytest
import torch

from hybridflow.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    get_kl_controller,
    kl_penalty,
)

D = torch.float64
LOGP = torch.tensor([[0.5, -1.0]], dtype=D)
REF = torch.tensor([[0.2, -1.0]], dtype=D)


@pytest.mark.parametrize(
    "names, expected",
    [
        # log r = 0.3 on the first token, 0 on the second
        (("kl", "k1"), 0.3),
        (("abs",), 0.3),
        (("mse", "k2"), 0.5 * 0.3**2),  # 0.045
        (("low_var_kl", "k3"), math.exp(-0.3) + 0.3 - 1),  # 0.740818 + 0.3 - 1 = 0.040818
    ],
)
def test_estimators_and_aliases(names, expected):
    for name in names:
        out = kl_penalty(LOGP, REF, name)
        torch.testing.assert_close(out, torch.tensor([[expected, 0.0]], dtype=D))


def test_k1_can_be_negative_and_abs_not():
    assert kl_penalty(REF, LOGP, "k1")[0, 0].item() == pytest.approx(-0.3)
    assert kl_penalty(REF, LOGP, "abs")[0, 0].item() == pytest.approx(0.3)


def test_low_var_kl_is_clamped():
    # ref - logp = 30 -> clamped to 20 -> e^20 - 20 - 1 is huge -> clamped to 10
    out = kl_penalty(torch.tensor([0.0], dtype=D), torch.tensor([30.0], dtype=D), "k3")
    assert out.item() == 10.0


def test_straight_through_variant_keeps_value_takes_k2_gradient():
    logp = LOGP.clone().requires_grad_(True)
    out = kl_penalty(logp, REF, "k3+")
    torch.testing.assert_close(out.detach(), kl_penalty(LOGP, REF, "k3"))
    out.sum().backward()
    # d/dlogp 0.5 (logp - ref)^2 = logp - ref
    torch.testing.assert_close(logp.grad, LOGP - REF)


def test_unknown_estimator_lists_names():
    with pytest.raises(ValueError, match="abs, k1, k2, k3, kl, low_var_kl, mse"):
        kl_penalty(LOGP, REF, "full")


def test_fixed_controller_never_changes():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=10.0, n_steps=256)
    assert ctrl.value == 0.05


def test_adaptive_controller_update():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    # KL 9 -> error clip(9 / 6 - 1 = 0.5) = 0.2 -> mult 1 + 0.2 * 256 / 10000 = 1.00512
    ctrl.update(current_kl=9.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.2 * 1.00512)
    # KL 5.4 -> error 5.4 / 6 - 1 = -0.1 (inside the clip) -> mult 1 - 0.1 * 100 / 10000 = 0.999
    ctrl.update(current_kl=5.4, n_steps=100)
    assert ctrl.value == pytest.approx(0.2 * 1.00512 * 0.999)


def test_get_kl_controller():
    assert isinstance(get_kl_controller("fixed", 0.001), FixedKLController)
    adaptive = get_kl_controller("adaptive", 0.001, target_kl=0.1, horizon=10000)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.001
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller("adaptive", 0.001, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="adaptive, fixed"):
        get_kl_controller("pid", 0.001)


def test_apply_kl_penalty_to_rewards():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=D)
    old = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    rewards, current_kl = apply_kl_penalty_to_rewards(scores, old, torch.zeros_like(old), mask, 0.5, "kl")
    # k1 = old - ref = old, zeroed past the mask; rewards = scores - 0.5 * kl
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 0.75, 0.0]], dtype=D)
    torch.testing.assert_close(rewards, expected)
    # per-sequence masked means 0.2 and 0.45 -> batch mean 0.325
    assert current_kl == pytest.approx(0.325)
