from types import SimpleNamespace

import pytest

from hybridflow.utils.flops_counter import (
    FlopsCounter,
    default_peak_flops,
    estimate_decoder_flops,
    measure_peak_flops_cpu,
)

# hidden 8, 2 heads of dim 4, 1 KV head, MLP 16, 2 layers, vocab 10.
TINY = dict(
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=10,
)


def test_tiny_config_by_hand():
    # Per layer: MLP 3*8*16 = 384; attention 8 * (q 8 + k 4 + v 4 + o 8) = 192 -> 576.
    # Dense N = 2 * 576 + 2 * 10 * 8 = 1152 + 160 = 1312.
    # Sequences 3 and 5: 8 tokens -> dense 6 * 1312 * 8 = 62976;
    # causal attention (verl): 6 * 2 layers * (9 + 25) * head_dim 4 * 2 heads = 3264 -- QK^T and AV at
    # 2 FLOPs per multiply-add (4), x3 for backward (12), halved for the causal triangle (6).
    # Total 62976 + 3264 = 66240 in 2 s.
    achieved, n_params = estimate_decoder_flops(TINY, [3, 5], delta_time_s=2.0)
    assert n_params == 1312
    assert achieved == pytest.approx(66240 / 2)
    # The same through an attribute-style config.
    assert estimate_decoder_flops(SimpleNamespace(**TINY), [3, 5], 2.0)[0] == pytest.approx(33120)


def test_explicit_head_dim():
    # Qwen3-style head_dim 6 != hidden/heads: q = 12, kv = 6 each, o = 12 -> attention 8 * 36 = 288.
    config = {**TINY, "head_dim": 6}
    _, n_params = estimate_decoder_flops(config, [1], 1.0)
    assert n_params == 2 * (384 + 288) + 160
    achieved, _ = estimate_decoder_flops(config, [1], 1.0)
    assert achieved == 6 * n_params + 6 * 2 * 1 * 6 * 2


def test_counter_and_peaks():
    counter = FlopsCounter(TINY, peak_flops_per_s=66240.0)
    assert counter.estimate([3, 5], 1.0) == (pytest.approx(66240.0), 66240.0)
    assert counter.mfu([3, 5], 2.0) == pytest.approx(0.5)
    assert default_peak_flops("cpu", "bf16", 2) == 840e9
    assert default_peak_flops("cpu", "float32", 1) == 100e9
    assert default_peak_flops("cpu", "bf16", 2, configured=1e9) == 1e9
    assert default_peak_flops("cuda", "bfloat16", 1, device_name="NVIDIA H100 80GB HBM3") == 989e12
    with pytest.raises(ValueError, match="configured"):
        default_peak_flops("cuda", "bfloat16", 1, device_name="Mystery GPU")


def test_measure_peak_cpu_runs():
    assert measure_peak_flops_cpu("float32", n=128, repeats=2) > 1e6
