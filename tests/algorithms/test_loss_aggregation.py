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
    # verl: the SUM of the sequence sums (3 + 4 = 7), divided by T = 3 (default) or by the constant
    # loss_scale_factor 7 -- not a mean over sequences (that would be 3.5 / 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),
        ("seq-mean-token-sum", 3.5),
        ("seq-mean-token-mean", 2.75),
        ("seq-mean-token-sum-norm", 7 / 3),
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


# ----------------------------------------------------------------------------- global normalisation
# A mini-batch split into micro-batches (and ranks) must give the gradient of the whole mini-batch.
# Rows below: 4 sequences with 2, 1, 3 and 0 valid tokens (N = 6 tokens, G = 3 sequences).
ROWS = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0], [3.0, 5.0, 7.0], [9.0, 9.0, 9.0]], dtype=D)
ROW_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=D)
WHOLE = {  # hand-derived values for the 4 rows in one call
    "token-mean": (1 + 2 + 4 + 3 + 5 + 7) / 6,
    "seq-mean-token-sum": (3 + 4 + 15) / 3,
    "seq-mean-token-mean": (1.5 + 4 + 5) / 3,
    "seq-mean-token-sum-norm": (3 + 4 + 15) / 3,  # T = 3
}


@pytest.mark.parametrize("mode", sorted(WHOLE))
def test_micro_batches_with_global_counts_sum_to_the_whole(mode):
    assert agg_loss(ROWS, ROW_MASK, mode).item() == pytest.approx(WHOLE[mode])
    # unequal micro-batches [row 0], [rows 1-3]: each normalised by the mini-batch's N and G
    parts = [
        agg_loss(ROWS[s], ROW_MASK[s], mode, batch_num_tokens=6, global_batch_size=3)
        for s in (slice(0, 1), slice(1, 4))
    ]
    assert sum(p.item() for p in parts) == pytest.approx(WHOLE[mode])


def test_row_weighted_micro_means_differ_from_token_mean():
    # The old scheme (each micro-batch's own mean weighted by its rows) gives another number:
    # 1/4 * 1.5 + 3/4 * (4 + 3 + 5 + 7) / 4 = 3.9375, while the token mean is 22 / 6 = 3.667.
    old = 0.25 * agg_loss(ROWS[:1], ROW_MASK[:1], "token-mean") + 0.75 * agg_loss(
        ROWS[1:], ROW_MASK[1:], "token-mean"
    )
    assert old.item() == pytest.approx(3.9375)
    assert WHOLE["token-mean"] == pytest.approx(22 / 6)


@pytest.mark.parametrize("mode", sorted(WHOLE))
def test_dp_ranks_times_average_equals_whole(mode):
    # Two ranks hold rows [0, 1] and [2, 3]; FSDP averages their gradients, so each multiplies by dp_size.
    rank_losses = [
        agg_loss(ROWS[s], ROW_MASK[s], mode, dp_size=2, batch_num_tokens=6, global_batch_size=3)
        for s in (slice(0, 2), slice(2, 4))
    ]
    assert sum(x.item() for x in rank_losses) / 2 == pytest.approx(WHOLE[mode])


def test_sum_norm_uses_the_constant_not_the_width():
    # A trimmed width (2 columns) must not change the divisor when loss_scale_factor is given.
    wide = agg_loss(ROWS, ROW_MASK, "seq-mean-token-sum-norm", loss_scale_factor=16)
    narrow = agg_loss(ROWS[:2, :2], ROW_MASK[:2, :2], "seq-mean-token-sum-norm", loss_scale_factor=16)
    assert wide.item() == pytest.approx(22 / 16)
    assert narrow.item() == pytest.approx(7 / 16)


@pytest.mark.parametrize("mode", sorted(WHOLE))
def test_nan_in_masked_positions_is_ignored(mode):
    poisoned = ROWS.clone().requires_grad_(True)
    nan = torch.tensor(float("nan"), dtype=D)
    values = poisoned + torch.where(ROW_MASK == 0, nan, torch.zeros((), dtype=D))
    out = agg_loss(values, ROW_MASK, mode)
    assert out.item() == pytest.approx(WHOLE[mode])
    out.backward()
    assert torch.isfinite(poisoned.grad).all()
