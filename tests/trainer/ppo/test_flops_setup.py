"""``perf/mfu/actor``'s counter as main_ppo builds it: ``fsdp_config.mixed_precision=auto`` (which
crashed start-up, the string read as a dict) picks the peak of the dtype ``auto`` resolves to."""

import pytest

from hybridflow.trainer.config import load_config
from hybridflow.trainer.ppo.workers_setup import _flops_counter
from hybridflow.utils.flops_counter import CPU_PEAK_FLOPS_PER_CORE


@pytest.mark.parametrize("fast_bf16", [True, False], ids=["avx512_bf16", "no_fast_bf16"])
def test_auto_mixed_precision_peak_follows_the_resolved_dtype(tiny_model_dir, monkeypatch, fast_bf16):
    from hybridflow.workers import fsdp_utils

    monkeypatch.setattr(fsdp_utils, "has_fast_bf16", lambda kind=None: fast_bf16)
    config = load_config(
        [
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision=auto",
            "trainer.num_threads_per_worker=2",
        ]
    )
    counter = _flops_counter(config, ["cpu"])
    per_core = CPU_PEAK_FLOPS_PER_CORE["bfloat16" if fast_bf16 else "float32"]
    assert counter.peak_flops_per_s == 2 * per_core  # 2 threads x the per-core matmul peak
    assert counter.config.num_hidden_layers == 2  # the actor's own model config


def test_explicit_mixed_precision_and_model_dtype_pick_their_peaks(tiny_model_dir):
    base = [f"actor_rollout_ref.model.path={tiny_model_dir}"]
    mixed = "actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}"
    assert (
        _flops_counter(load_config([*base, mixed]), ["cpu"]).peak_flops_per_s
        == CPU_PEAK_FLOPS_PER_CORE["bfloat16"]
    )
    assert _flops_counter(load_config(base), ["cpu"]).peak_flops_per_s == CPU_PEAK_FLOPS_PER_CORE["float32"]
    configured = _flops_counter(load_config([*base, "trainer.peak_flops_per_worker=1e12"]), ["cpu"])
    assert configured.peak_flops_per_s == 1e12


def test_cuda_peak_comes_from_the_workers_gpu_name_and_unknown_gpus_give_no_mfu(tiny_model_dir):
    # The driver asks no GPU itself (a head node may have none): the name is what the workers reported.
    # On CUDA the default compute dtype is bf16 (verl's mixed precision default).
    config = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.device=cuda"])
    assert _flops_counter(config, ["NVIDIA H100 80GB HBM3"]).peak_flops_per_s == 989e12
    assert _flops_counter(config, ["NVIDIA H100 PCIe"]).peak_flops_per_s == 756e12
    assert _flops_counter(config, ["NVIDIA Imaginary 9000"]) is None
    configured = load_config([*config_overrides(tiny_model_dir), "trainer.peak_flops_per_worker=5e14"])
    assert _flops_counter(configured, ["NVIDIA Imaginary 9000"]).peak_flops_per_s == 5e14


def config_overrides(model_dir):
    return [f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cuda"]
