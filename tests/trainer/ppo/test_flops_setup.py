"""``perf/mfu/actor``'s counter as main_ppo builds it: ``fsdp_config.mixed_precision=auto`` (which
crashed start-up, the string read as a dict) picks the peak of the dtype ``auto`` resolves to."""

import pytest

from hybridflow.trainer.config import load_config
from hybridflow.trainer.ppo.workers_setup import _flops_counter
from hybridflow.utils.flops_counter import CPU_PEAK_FLOPS_PER_CORE


@pytest.mark.parametrize("fast_bf16", [True, False], ids=["avx512_bf16", "no_fast_bf16"])
def test_auto_mixed_precision_peak_follows_the_resolved_dtype(tiny_model_dir, monkeypatch, fast_bf16):
    from hybridflow.workers import fsdp_utils

    monkeypatch.setattr(fsdp_utils, "cpu_has_fast_bf16", lambda: fast_bf16)
    config = load_config(
        [
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision=auto",
            "trainer.num_threads_per_worker=2",
        ]
    )
    counter = _flops_counter(config)
    per_core = CPU_PEAK_FLOPS_PER_CORE["bfloat16" if fast_bf16 else "float32"]
    assert counter.peak_flops_per_s == 2 * per_core  # 2 threads x the per-core matmul peak
    assert counter.config.num_hidden_layers == 2  # the actor's own model config


def test_explicit_mixed_precision_and_model_dtype_pick_their_peaks(tiny_model_dir):
    base = [f"actor_rollout_ref.model.path={tiny_model_dir}"]
    mixed = "actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}"
    assert _flops_counter(load_config([*base, mixed])).peak_flops_per_s == CPU_PEAK_FLOPS_PER_CORE["bfloat16"]
    assert _flops_counter(load_config(base)).peak_flops_per_s == CPU_PEAK_FLOPS_PER_CORE["float32"]
    configured = _flops_counter(load_config([*base, "trainer.peak_flops_per_worker=1e12"]))
    assert configured.peak_flops_per_s == 1e12
