"""Model FLOPs of a training step and the device peak they are compared with (MFU = achieved / peak).

The per-architecture counts live in :mod:`hybridflow.utils.flops_formulas` (verl's formulas for
llama, qwen2/3, qwen3_moe, deepseek_v3, mistral, gemma3_text, apertus, gpt_oss, qwen3_vl, ...). For the
Llama/Qwen-style decoder (SwiGLU MLP, GQA attention), forward + backward:

- dense: ``6 * N * tokens`` with ``N = L * (3 * H * I + H * (q + k + v + o)) + 2 * V * H`` (embedding and
  LM head both counted, as verl does, even when tied);
- attention scores: ``6 * L * sum(seqlen^2) * head_dim * heads``: QK^T and AV are ``2 * s^2 * d`` FLOPs
  each (2 per multiply-add) for one head, x3 for forward + backward, halved because causal attention
  only computes the lower triangle (verl's current count).

CPU peaks are the platform notes' measured matmul 2048^2 rates per core: fp32 100 GFLOP/s, bf16 420.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.utils.flops_formulas import FORMULAS, cfg, dense_decoder_params, step_flops

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


_cfg = cfg
decoder_dense_params = dense_decoder_params  # the Llama-style count, under its earlier name


def estimate_decoder_flops(config: Any, batch_seqlens: list[int], delta_time_s: float) -> tuple[float, int]:
    """Training FLOP/s of a Llama-style decoder on ``batch_seqlens`` (real tokens per sequence) in
    ``delta_time_s``. Returns ``(achieved_flops_per_s, n_dense_params)``."""
    if delta_time_s <= 0:
        raise ValueError(f"delta_time_s must be positive, got {delta_time_s}")
    return step_flops(config, batch_seqlens, model_type="llama") / delta_time_s, dense_decoder_params(config)


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


# Config fields that mark a mixture of experts: counting one as a dense decoder would be wrong.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


class FlopsCounter:
    """Model FLOP utilisation of one model: achieved FLOP/s of a step against the device peak.

    ``FlopsCounter(hf_config)`` picks the formula of ``config.model_type`` (see
    :data:`hybridflow.utils.flops_formulas.FORMULAS`); a config without ``model_type`` (a plain dict)
    is counted as a Llama-style decoder. An unknown ``model_type`` is counted that way too when its
    config looks like one, with a warning; a mixture of experts or a config without the decoder
    fields gets no count at all (NaN, with a warning) rather than a wrong one (verl reports 0).

    ``peak_flops_per_s``: one worker's peak; by default that of this process's device (see
    :func:`default_peak_flops`; infinite for an unknown GPU, so MFU reads 0 as in verl).
    """

    def __init__(self, config: Any, peak_flops_per_s: float | None = None) -> None:
        if peak_flops_per_s is not None and peak_flops_per_s <= 0:
            raise ValueError(f"peak_flops_per_s must be positive, got {peak_flops_per_s}")
        self.config = config
        self._peak = None if peak_flops_per_s is None else float(peak_flops_per_s)
        self.model_type = _cfg(config, "model_type")
        self.formula = self._choose_formula()

    def _choose_formula(self) -> str | None:
        if self.model_type in FORMULAS:
            return self.model_type
        dense_fields = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        )
        looks_dense = all(_cfg(self.config, f) is not None for f in dense_fields) and not any(
            _cfg(self.config, f) is not None for f in _MOE_FIELDS
        )
        if self.model_type is None and looks_dense:
            return "llama"
        known = ", ".join(sorted(FORMULAS))
        if looks_dense:
            warnings.warn(
                f"FlopsCounter: no FLOPs formula for model_type {self.model_type!r}; counting it as a "
                f"Llama-style dense decoder (known: {known})",
                stacklevel=3,
            )
            return "llama"
        warnings.warn(
            f"FlopsCounter: no FLOPs formula for model_type {self.model_type!r} (known: {known}); "
            "MFU is not reported (NaN)",
            stacklevel=3,
        )
        return None

    @property
    def peak_flops_per_s(self) -> float:
        if self._peak is None:
            self._peak = _this_device_peak()
        return self._peak

    def flops(self, batch_seqlens: Sequence[int]) -> float:
        """Training FLOPs of sequences of ``batch_seqlens`` tokens (NaN: no formula for the model)."""
        if self.formula is None:
            return float("nan")
        return float(step_flops(self.config, batch_seqlens, model_type=self.formula))

    def saved_fraction(self, rows: Sequence[int], repeated_prompts: Sequence[int]) -> float:
        """The share of the FLOPs of ``rows`` (real tokens per row) that a shared-prompt layout did not
        compute: those of sequences of ``repeated_prompts`` tokens (see
        :func:`hybridflow.workers.shared_prefix.repeated_prompts`); 0 with no rows."""
        total = self.flops(rows) if rows else 0.0
        return self.flops(repeated_prompts) / total if total and repeated_prompts else 0.0

    def estimate(
        self, batch_seqlens: Sequence[int], delta_time: float, images_seqlens: Sequence[int] | None = None
    ) -> tuple[float, float]:
        """``(achieved_flops_per_s, peak_flops_per_s)``; MFU is their ratio."""
        if delta_time <= 0:
            raise ValueError(f"delta_time must be positive, got {delta_time}")
        if self.formula is None:
            return float("nan"), self.peak_flops_per_s
        flops = step_flops(self.config, batch_seqlens, images_seqlens, model_type=self.formula)
        return flops / delta_time, self.peak_flops_per_s

    def estimate_flops(
        self, batch_seqlens: Sequence[int], delta_time: float, **kwargs
    ) -> tuple[float, float]:
        """verl's call: ``(achieved, promised)`` in TFLOP/s (1e12); ``images_seqlens=`` for Qwen3-VL."""
        achieved, peak = self.estimate(batch_seqlens, delta_time, kwargs.get("images_seqlens"))
        return achieved / 1e12, peak / 1e12

    def mfu(self, batch_seqlens: Sequence[int], delta_time: float) -> float:
        achieved, peak = self.estimate(batch_seqlens, delta_time)
        return achieved / peak


def _this_device_peak() -> float:
    """Peak FLOP/s of this process's device in its default compute dtype (inf for an unknown GPU)."""
    from hybridflow.utils.device import default_compute_dtype, device_type

    kind = device_type()
    try:
        return default_peak_flops(kind, default_compute_dtype(kind), torch.get_num_threads())
    except ValueError:
        return float("inf")
