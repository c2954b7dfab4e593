import pytest
import torch

from hybridflow.algorithms import compute_value_loss

D = torch.float64


def test_clipped_value_loss_hand_value():
    # token 0: V_old 1.0, V_new 1.5 clipped to 1.2; R = 2: errors 0.25 (unclipped) vs 0.64 (clipped) -> 0.64
    # token 1: V_new = V_old = 0, R = 1: both errors 1 -> 1 (not counted as clipped)
    # token 2 is masked. vf_loss = 0.5 * mean(0.64, 1) = 0.41; clipfrac 1 / 2
    vpreds = torch.tensor([[1.5, 0.0, 9.0]], dtype=D, requires_grad=True)
    values = torch.tensor([[1.0, 0.0, 0.0]], dtype=D)
    returns = torch.tensor([[2.0, 1.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]], dtype=D)
    vf_loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    assert vf_loss.item() == pytest.approx(0.41)
    assert clipfrac.item() == pytest.approx(0.5)
    vf_loss.backward()
    # clipped token: no gradient; token 1: 0.5 * 2 (v - R) / 2 tokens = -0.5
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, -0.5, 0.0]], dtype=D))


def test_value_loss_unclipped_when_close():
    # V_new 1.1 within 0.2 of V_old 1.0; R 2: 0.5 * 0.81
    vf_loss, clipfrac = compute_value_loss(
        torch.tensor([[1.1]]),
        torch.tensor([[2.0]]),
        torch.tensor([[1.0]]),
        torch.ones(1, 1),
        0.2,
        loss_agg_mode="seq-mean-token-sum",
    )
    assert vf_loss.item() == pytest.approx(0.405)
    assert clipfrac.item() == 0.0


def test_value_loss_micro_batches_with_global_counts_sum_to_whole():
    # rows with 2 and 1 valid tokens; unclipped squared errors [1, 4 | 9] -> token-mean 0.5 * 14 / 3
    vpreds = torch.tensor([[1.0, 2.0], [3.0, 0.0]], dtype=torch.float64)
    returns = torch.zeros_like(vpreds)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    whole, _ = compute_value_loss(vpreds, returns, vpreds, mask, 0.5, "token-mean")
    parts = [
        compute_value_loss(
            vpreds[i : i + 1],
            returns[i : i + 1],
            vpreds[i : i + 1],
            mask[i : i + 1],
            0.5,
            "token-mean",
            batch_num_tokens=3,
        )[0]
        for i in range(2)
    ]
    assert whole.item() == pytest.approx(0.5 * 14 / 3)
    assert sum(p.item() for p in parts) == pytest.approx(0.5 * 14 / 3)
