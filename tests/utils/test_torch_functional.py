import math

import pytest
import torch
import torch.nn.functional as F

from hybridflow.utils.torch_functional import (
    clip_by_value,
    entropy_from_logits,
    get_response_mask,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

D = torch.float64


def test_masked_sum_and_mean():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=D)
    # sum = 1 + 2 + 4 = 7 over 3 tokens
    assert masked_sum(values, mask).item() == 7.0
    assert masked_mean(values, mask).item() == pytest.approx(7 / 3)
    # per row: (1 + 2) / 2 = 1.5 and 4 / 1 = 4
    torch.testing.assert_close(masked_mean(values, mask, axis=-1), torch.tensor([1.5, 4.0], dtype=D))


def test_masked_mean_fully_masked_is_zero_with_finite_grad():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=D, requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]], dtype=D)
    per_row = masked_mean(values, mask, axis=-1)
    torch.testing.assert_close(per_row, torch.tensor([1.5, 0.0], dtype=D))
    total = masked_mean(values, torch.zeros_like(mask))
    assert total.item() == 0.0
    (per_row.sum() + total).backward()
    assert torch.isfinite(values.grad).all()
    torch.testing.assert_close(values.grad, torch.tensor([[0.5, 0.5], [0.0, 0.0]], dtype=D))


def test_masked_var_unbiased_and_biased():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0], dtype=D)
    mask = torch.tensor([1, 1, 1, 0], dtype=D)
    # mean 2, squared deviations 1 + 0 + 1 = 2; unbiased 2 / 2 = 1, biased 2 / 3
    assert masked_var(values, mask).item() == pytest.approx(1.0)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)


def test_masked_var_degenerate_counts_are_zero():
    values = torch.tensor([5.0, 7.0], dtype=D)
    assert masked_var(values, torch.tensor([1.0, 0.0], dtype=D)).item() == 0.0
    assert masked_var(values, torch.zeros(2, dtype=D)).item() == 0.0


def test_masked_whiten():
    values = torch.tensor([[1.0, 2.0, 3.0, 50.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=D)
    # mean 2, unbiased var 1 -> (x - 2) / sqrt(1 + 1e-8)
    scale = 1 / math.sqrt(1 + 1e-8)
    out = masked_whiten(values, mask)
    torch.testing.assert_close(out[0, :3], torch.tensor([-1.0, 0.0, 1.0], dtype=D) * scale)
    out_keep = masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(out_keep[0, :3], torch.tensor([-1.0, 0.0, 1.0], dtype=D) * scale + 2)


def test_masked_whiten_fully_masked_is_finite():
    out = masked_whiten(torch.tensor([[1.0, 2.0]], dtype=D), torch.zeros(1, 2, dtype=D))
    assert torch.isfinite(out).all()


def test_clip_by_value():
    x = torch.tensor([0.0, 1.5, 3.0])
    lo, hi = torch.tensor([0.5, 0.5, 0.5]), torch.tensor([2.0, 2.0, 2.0])
    torch.testing.assert_close(clip_by_value(x, lo, hi), torch.tensor([0.5, 1.5, 2.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logprobs_from_logits_matches_log_softmax(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(19, 5, 11, generator=gen, dtype=torch.float64)  # 19 rows: several chunks
    labels = torch.randint(0, 11, (19, 5), generator=gen)
    expected = F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    got = logprobs_from_logits(logits.to(dtype), labels)
    assert got.shape == (19, 5) and got.dtype == dtype
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


def test_logprobs_from_logits_hand_value_and_grad():
    # logits [0, ln 3] -> softmax [1/4, 3/4]; label 1 -> log(3/4)
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=D, requires_grad=True)
    out = logprobs_from_logits(logits, torch.tensor([[1]]))
    assert out.item() == pytest.approx(math.log(0.75))
    out.sum().backward()
    # d log p_1 / d z = onehot(1) - softmax = [-1/4, 1/4]
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.25, 0.25]]], dtype=D))


def test_entropy_from_logits():
    uniform = torch.zeros(2, 3, 4, dtype=D)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(4), dtype=D))
    # p = [1/4, 3/4] -> H = -(1/4 ln 1/4 + 3/4 ln 3/4)
    logits = torch.tensor([0.0, math.log(3.0)], dtype=D)
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(logits).item() == pytest.approx(expected)


def test_get_response_mask():
    ids = torch.tensor([[5, 7, 2, 0, 2], [2, 9, 9, 9, 9], [4, 4, 4, 4, 4], [4, 3, 4, 2, 4]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    got = get_response_mask(ids, eos_token_id=[2, 3], dtype=torch.int64)
    torch.testing.assert_close(got, expected)
    single = get_response_mask(ids[:1], eos_token_id=2, dtype=torch.float32)
    assert single.dtype == torch.float32
    torch.testing.assert_close(single, expected[:1].float())


def test_masked_mean_ignores_nan_at_masked_positions():
    # verl's example: values [1, 2, nan, 4] under mask [1, 0, 0, 1] -> (1 + 4) / 2 = 2.5
    values = torch.tensor([1.0, 2.0, float("nan"), 4.0], requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 0.0, 1.0])
    out = masked_mean(values, mask)
    assert out.item() == 2.5
    out.backward()
    torch.testing.assert_close(values.grad, torch.tensor([0.5, 0.0, 0.0, 0.5]))
    assert masked_mean(values, mask.bool()).item() == 2.5


def test_entropy_chunked_equals_full_with_gradient():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, dtype=torch.float64, requires_grad=True)
    full = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)  # float64 reference
    chunked = entropy_from_logits(logits, chunk_tokens=4)  # 21 positions in 6 chunks
    torch.testing.assert_close(chunked, full)
    (g_full,) = torch.autograd.grad(full.sum(), logits)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    torch.testing.assert_close(g_chunked, g_full)
    with torch.no_grad():
        torch.testing.assert_close(entropy_from_logits(logits, chunk_tokens=5), full)


def test_entropy_keeps_no_full_vocabulary_temporaries_for_backward():
    # The unchunked form saves softmax(logits) — another (N, V) tensor — for the backward pass; the
    # chunked form saves only views of the logits themselves (each chunk is recomputed in backward).
    logits = torch.randn(4, 512, 64, requires_grad=True)

    def saved_bytes(fn):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(logits)
        storages.pop(logits.untyped_storage().data_ptr(), None)
        return sum(storages.values())

    logits_bytes = logits.numel() * 4
    assert saved_bytes(lambda z: entropy_from_logits(z, chunk_tokens=1 << 20)) >= logits_bytes
    assert saved_bytes(lambda z: entropy_from_logits(z, chunk_tokens=256)) < logits_bytes / 8
