"""Model FLOPs of a training step and the device peak they are compared with (MFU = achieved / peak).

The count is verl's for Llama/Qwen2/Qwen3-style decoders (SwiGLU MLP, GQA attention), forward + backward:

- dense: ``6 * N * tokens`` with ``N = L * (3 * H * I + H * (q + k + v + o)) + 2 * V * H`` (embedding and
  LM head both counted, as verl does, even when tied);
- attention scores: ``6 * L * sum(seqlen^2) * head_dim * heads``: QK^T and AV are ``2 * s^2 * d`` FLOPs
  each (2 per multiply-add) for one head, x3 for forward + backward, halved because causal attention
  only computes the lower triangle (verl's current count).

CPU peaks are the platform notes' measured matmul 2048^2 rates per core: fp32 100 GFLOP/s, bf16 420.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "FlopsCounter",
    "estimate_decoder_flops",
    "default_peak_flops",
    "measure_peak_flops_cpu",
]

# Per-core matmul throughput measured on the project's CPUs (PLATFORM_NOTES.md).
CPU_PEAK_FLOPS_PER_CORE = {"float32": 100e9, "bfloat16": 420e9}

# Dense (no sparsity) tensor-core peaks from the vendor datasheets; fp32 means TF32 matmul.
# The most specific name that the device name contains wins (``H100 PCIe`` before ``H100``).
GPU_PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float32": 494.5e12},
    "H100 PCIe": {"bfloat16": 756e12, "float32": 378e12},
    "H100 NVL": {"bfloat16": 835e12, "float32": 417.5e12},
    "H100": {"bfloat16": 989e12, "float32": 494.5e12},  # SXM
    "A100": {"bfloat16": 312e12, "float32": 156e12},
}

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
}


def _normalize_dtype(dtype: str | torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    """Read a field from an HF config object or a plain dict."""
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def decoder_dense_params(config: Any) -> int:
    """Parameters that multiply every token (all linear layers + embedding + LM head), as verl counts."""
    hidden = _cfg(config, "hidden_size")
    heads = _cfg(config, "num_attention_heads")
    kv_heads = _cfg(config, "num_key_value_heads", heads)
    head_dim = _cfg(config, "head_dim", hidden // heads)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    mlp = 3 * hidden * _cfg(config, "intermediate_size")  # gate, up, down
    attn = hidden * (q_size + 2 * kv_size + q_size)  # q, k, v, o projections
    embed_and_head = 2 * _cfg(config, "vocab_size") * hidden
    return _cfg(config, "num_hidden_layers") * (mlp + attn) + embed_and_head


def estimate_decoder_flops(config: Any, batch_seqlens: list[int], delta_time_s: float) -> tuple[float, int]:
    """Training FLOP/s achieved on ``batch_seqlens`` (real tokens per sequence) in ``delta_time_s``.

    Returns ``(achieved_flops_per_s, n_dense_params)``.
    """
    if delta_time_s <= 0:
        raise ValueError(f"delta_time_s must be positive, got {delta_time_s}")
    n_params = decoder_dense_params(config)
    heads = _cfg(config, "num_attention_heads")
    head_dim = _cfg(config, "head_dim", _cfg(config, "hidden_size") // heads)
    tokens = sum(batch_seqlens)
    seqlen_sq = sum(s * s for s in batch_seqlens)
    dense_flops = 6 * n_params * tokens
    # (QK^T + AV) x (fwd + 2 bwd) x causal half = (2 + 2) * 3 / 2 = 6 FLOPs per (s^2 * head_dim) per head.
    attn_flops = 6 * _cfg(config, "num_hidden_layers") * seqlen_sq * head_dim * heads
    return (dense_flops + attn_flops) / delta_time_s, n_params


def default_peak_flops(
    device: str,
    dtype: str | torch.dtype,
    num_threads: int,
    configured: float | None = None,
    device_name: str | None = None,
) -> float:
    """Peak FLOP/s for one worker: ``configured`` if given, else the table for the device.

    CPU: the per-core number for ``dtype`` times ``num_threads``. CUDA: dense bf16/TF32 peak looked up by
    GPU name (``device_name`` or ``torch.cuda.get_device_name``); an unknown GPU needs ``configured``.
    """
    if configured is not None:
        return float(configured)
    dtype_name = _normalize_dtype(dtype)
    if device.startswith("cpu"):
        if dtype_name not in CPU_PEAK_FLOPS_PER_CORE:
            known = sorted(CPU_PEAK_FLOPS_PER_CORE)
            raise ValueError(f"no CPU peak for dtype {dtype_name!r}; known: {known}")
        return CPU_PEAK_FLOPS_PER_CORE[dtype_name] * max(1, num_threads)
    if device.startswith("cuda"):
        name = device_name or torch.cuda.get_device_name()
        for gpu in sorted(GPU_PEAK_FLOPS, key=len, reverse=True):
            if gpu in name and dtype_name in GPU_PEAK_FLOPS[gpu]:
                return GPU_PEAK_FLOPS[gpu][dtype_name]
        raise ValueError(f"no peak FLOP/s known for GPU {name!r} ({dtype_name}); pass it as configured")
    raise ValueError(f"default_peak_flops: unsupported device {device!r}")


def measure_peak_flops_cpu(dtype: str | torch.dtype = "bfloat16", n: int = 1024, repeats: int = 3) -> float:
    """Best-of-``repeats`` FLOP/s of an ``n x n`` matmul in ``dtype`` with the current torch threads."""
    torch_dtype = getattr(torch, _normalize_dtype(dtype))
    a = torch.randn(n, n).to(torch_dtype)
    b = torch.randn(n, n).to(torch_dtype)
    torch.mm(a, b)  # warm-up: first call pays for allocation and kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / max(best, 1e-9)


class FlopsCounter:
    """Model FLOP utilisation of a decoder: ``estimate`` returns achieved and peak FLOP/s."""

    def __init__(self, config: Any, peak_flops_per_s: float) -> None:
        if peak_flops_per_s <= 0:
            raise ValueError(f"peak_flops_per_s must be positive, got {peak_flops_per_s}")
        self.config = config
        self.peak_flops_per_s = float(peak_flops_per_s)
        self.n_params = decoder_dense_params(config)

    def estimate(self, batch_seqlens: list[int], delta_time: float) -> tuple[float, float]:
        """``(achieved_flops_per_s, peak_flops_per_s)``; MFU is their ratio."""
        achieved, _ = estimate_decoder_flops(self.config, batch_seqlens, delta_time)
        return achieved, self.peak_flops_per_s

    def mfu(self, batch_seqlens: list[int], delta_time: float) -> float:
        achieved, peak = self.estimate(batch_seqlens, delta_time)
        return achieved / peak
