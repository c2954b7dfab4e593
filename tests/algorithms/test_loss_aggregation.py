import pytest
import torch

from hybridflow.algorithms import LOSS_AGG_MODES, agg_loss

D = torch.float64
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=D)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=D)


def test_token_mean():
    # (1 + 2 + 4) / 3 valid tokens
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx(7 / 3)


def test_seq_mean_token_sum():
    # sequence sums 3 and 4 -> mean 3.5
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx(3.5)


def test_seq_mean_token_mean():
    # sequence means 1.5 and 4 -> mean 2.75
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx(2.75)


def test_seq_mean_token_sum_norm():
    # mean of sequence sums 3.5, divided by T = 3 (default) or by the constant loss_scale_factor 7
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(3.5 / 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),
        ("seq-mean-token-sum", 3.5),
        ("seq-mean-token-mean", 2.75),
        ("seq-mean-token-sum-norm", 3.5 / 3),
    ],
)
def test_fully_masked_rows_are_excluded(mode, expected):
    loss = torch.cat([LOSS, torch.tensor([[7.0, 8.0, 9.0]], dtype=D)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=D)])
    assert agg_loss(loss, mask, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
def test_fully_masked_batch_is_zero_with_finite_grad(mode):
    loss = LOSS.clone().requires_grad_(True)
    out = agg_loss(loss, torch.zeros_like(MASK), mode)
    assert out.item() == 0.0
    out.backward()
    assert torch.isfinite(loss.grad).all()


def test_token_mean_gradient_weights_each_token_equally():
    loss = LOSS.clone().requires_grad_(True)
    agg_loss(loss, MASK, "token-mean").backward()
    torch.testing.assert_close(loss.grad, MASK / 3)


def test_unknown_mode_lists_registered_modes():
    with pytest.raises(
        ValueError, match="seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean"
    ):
        agg_loss(LOSS, MASK, "sample-mean")
