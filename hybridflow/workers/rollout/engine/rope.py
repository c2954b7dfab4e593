"""Rotary position tables and their application, as the HF implementation computes them.

:func:`rope_table` asks the model's own rotary embedding for cos and sin, so every RoPE variant it
implements (linear, llama3, yarn, ...) comes out exactly as in its forward; :func:`apply_rope` is HF's
``x * cos + rotate_half(x) * sin`` with the sign flip folded into the sin table (:func:`signed_sin`).
"""

from __future__ import annotations

import torch
from torch import nn


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` (..., hd) with its first half negated: HF's ``rotate_half(x) * sin`` (rotate_half:
    ``cat(-x2, x1)``) is then ``x.roll(hd // 2, -1) * signed_sin(sin)`` bit for bit (a sign flip is
    exact), with no negation and concatenation per call."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` (x (..., hd)) with :func:`signed_sin`'s table."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def rope_table(
    module: nn.Module, max_positions: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_positions, hd) in fp32 from the model's own rotary embedding, so every RoPE
    variant it implements (linear, llama3, yarn, ...) comes out exactly as in its forward. ``layer_type``:
    which of a per-layer-type rotary embedding's tables (Gemma 3: ``"full_attention"``, or
    ``"sliding_attention"`` with its local base frequency)."""
    backbone = getattr(module, "model", module)
    backbone = getattr(backbone, "language_model", backbone)  # a vision-language model's decoder
    rotary = getattr(backbone, "rotary_emb", None)
    if rotary is None:
        raise NotImplementedError(f"{type(module).__name__} has no rotary_emb; the engine needs RoPE")
    kinds = getattr(rotary, "rope_type", "default")
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    if "dynamic" in kinds:
        raise NotImplementedError("dynamic NTK RoPE depends on the sequence length; use rollout.name=hf")
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq")
    probe = torch.zeros(1, dtype=torch.float32, device=inv_freq.device)
    positions = torch.arange(max_positions, device=probe.device).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rotary(probe, positions) if layer_type is None else rotary(probe, positions, layer_type)
    return cos[0].float().cpu(), sin[0].float().cpu()
