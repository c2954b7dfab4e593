"""Training FLOPs of one step, per architecture (forward + backward), counted as verl counts them.

Every formula has two parts:

- dense: ``6 * N * tokens``, where ``N`` are the weights each token multiplies (2 FLOPs per
  multiply-add, x3 for forward + backward): linear layers of every decoder layer plus the embedding
  and the LM head (both counted, as verl does, even when tied). For a mixture of experts ``N`` holds
  the router and only the ``top_k`` experts a token is routed to (plus shared experts);
- attention scores: QK^T and AV cost ``2 * s * s_kv * d`` each per head for a sequence of ``s``
  tokens attending to ``s_kv`` keys, x3 for backward, halved because causal attention computes only
  the lower triangle: ``6 * sum(s * s_kv) * head_dim * heads`` per layer. A sliding-window layer
  attends to ``s_kv = min(s, window)`` keys. The vision encoder of Qwen3-VL attends both ways (12).

The architectures (``model_type``) listed in :data:`FORMULAS` are those verl counts; its unit tests'
figures are reproduced exactly. Configs are HF config objects or dicts; multimodal configs read
their ``text_config`` / ``vision_config``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["FORMULAS", "DENSE_MODEL_TYPES", "cfg", "dense_decoder_params", "step_flops"]


def cfg(config: Any, name: str, default: Any = None) -> Any:
    """Field ``name`` of an HF config object or a dict (``default`` when absent or None)."""
    value = config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    return default if value is None else value


def _head_dim(config: Any) -> int:
    return cfg(config, "head_dim", cfg(config, "hidden_size") // cfg(config, "num_attention_heads"))


def _attn_proj_params(config: Any) -> int:
    """q, k, v and o projections of one GQA layer: ``H * (2 * heads + 2 * kv_heads) * head_dim``."""
    heads = cfg(config, "num_attention_heads")
    kv_heads = cfg(config, "num_key_value_heads", heads)
    return cfg(config, "hidden_size") * (2 * heads + 2 * kv_heads) * _head_dim(config)


def _embed_and_head_params(config: Any) -> int:
    return 2 * cfg(config, "vocab_size") * cfg(config, "hidden_size")


def _square_sum(seqlens: Sequence[int], window: int | None = None) -> int:
    """``sum(s * min(s, window))``: query-key pairs of one layer (all pairs without a window)."""
    return sum(s * (min(s, window) if window else s) for s in seqlens)


def _layer_types(config: Any) -> list[str] | None:
    """Per-layer ``full_attention`` / ``sliding_attention``: ``layer_types`` if given, else every
    ``sliding_window_pattern``-th layer full (Gemma 3's rule), else None (all full)."""
    types = cfg(config, "layer_types")
    if types:
        return list(types)
    pattern = cfg(config, "sliding_window_pattern")
    if pattern and cfg(config, "sliding_window"):
        n = cfg(config, "num_hidden_layers")
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    return None


def _causal_attention_flops(config: Any, seqlens: Sequence[int]) -> int:
    """``6 * pairs * head_dim * heads`` summed over the layers (sliding layers count fewer pairs)."""
    types = _layer_types(config)
    window = cfg(config, "sliding_window")
    if types is None:
        pairs = _square_sum(seqlens) * cfg(config, "num_hidden_layers")
    else:
        pairs = sum(_square_sum(seqlens, window if t == "sliding_attention" else None) for t in types)
    return 6 * pairs * _head_dim(config) * cfg(config, "num_attention_heads")


# ----------------------------------------------------------------------------- decoder weights per token


def dense_decoder_params(config: Any) -> int:
    """Llama/Qwen-style decoder: SwiGLU MLP (gate, up, down: ``3 H I``) + GQA projections per layer,
    plus embedding and LM head."""
    per_layer = 3 * cfg(config, "hidden_size") * cfg(config, "intermediate_size") + _attn_proj_params(config)
    return cfg(config, "num_hidden_layers") * per_layer + _embed_and_head_params(config)


def _apertus_params(config: Any) -> int:
    """Apertus: the xIELU MLP has no gate (``2 H I``); verl also counts the q/k norm weights
    (``H + kv_heads * head_dim``) per layer."""
    hidden = cfg(config, "hidden_size")
    qk_norm = hidden + cfg(config, "num_key_value_heads") * _head_dim(config)
    per_layer = 2 * hidden * cfg(config, "intermediate_size") + _attn_proj_params(config) + qk_norm
    return cfg(config, "num_hidden_layers") * per_layer + _embed_and_head_params(config)


def _moe_params(config: Any, expert_size_key: str, experts_key: str) -> int:
    """GQA attention + MoE MLP per layer: router ``H E`` + ``top_k`` SwiGLU experts of size ``I_e``
    (+ a shared expert when the config has ``shared_expert_intermediate_size``, as Qwen2-MoE)."""
    hidden = cfg(config, "hidden_size")
    experts = 3 * hidden * cfg(config, expert_size_key) * cfg(config, "num_experts_per_tok")
    shared = 3 * hidden * cfg(config, "shared_expert_intermediate_size", 0)
    per_layer = hidden * cfg(config, experts_key) + experts + shared + _attn_proj_params(config)
    return cfg(config, "num_hidden_layers") * per_layer + _embed_and_head_params(config)


def _mla_params(config: Any) -> int:
    """DeepSeek-V3 multi-head latent attention projections of one layer."""
    hidden, heads = cfg(config, "hidden_size"), cfg(config, "num_attention_heads")
    rope, nope, v_dim = (
        cfg(config, "qk_rope_head_dim"),
        cfg(config, "qk_nope_head_dim"),
        cfg(config, "v_head_dim"),
    )
    kv_rank, q_rank = cfg(config, "kv_lora_rank"), cfg(config, "q_lora_rank")
    q_head = nope + rope
    query = hidden * heads * q_head if q_rank is None else (hidden + heads * q_head) * q_rank
    key_value = hidden * (kv_rank + rope) + heads * (nope + v_dim) * kv_rank
    return query + key_value + heads * v_dim * hidden


# ----------------------------------------------------------------------------- formulas (total FLOPs)


def _dense(config: Any, seqlens: Sequence[int], **_) -> int:
    config = cfg(config, "text_config", config)  # Qwen2(.5)-VL in transformers 5: the decoder's sizes
    return 6 * dense_decoder_params(config) * sum(seqlens) + _causal_attention_flops(config, seqlens)


def _apertus(config: Any, seqlens: Sequence[int], **_) -> int:
    return 6 * _apertus_params(config) * sum(seqlens) + _causal_attention_flops(config, seqlens)


def _qwen_moe(config: Any, seqlens: Sequence[int], **_) -> int:
    params = _moe_params(config, "moe_intermediate_size", "num_experts")
    return 6 * params * sum(seqlens) + _causal_attention_flops(config, seqlens)


def _gpt_oss(config: Any, seqlens: Sequence[int], **_) -> int:
    params = _moe_params(config, "intermediate_size", "num_local_experts")
    return 6 * params * sum(seqlens) + _causal_attention_flops(config, seqlens)


def _deepseek_v3(config: Any, seqlens: Sequence[int], **_) -> int:
    """MLA attention; the first ``first_k_dense_replace`` layers have a dense SwiGLU MLP, the rest a
    router + (top_k + shared) experts. Scores: QK^T over ``nope + rope`` dims, AV over ``v_head_dim``."""
    hidden, layers = cfg(config, "hidden_size"), cfg(config, "num_hidden_layers")
    dense_layers = cfg(config, "first_k_dense_replace", 0)
    attn = _mla_params(config)
    active = cfg(config, "num_experts_per_tok") + cfg(config, "n_shared_experts", 0)
    moe_layer = (
        hidden * cfg(config, "n_routed_experts") + 3 * hidden * cfg(config, "moe_intermediate_size") * active
    )
    dense_layer = 3 * hidden * cfg(config, "intermediate_size")
    params = (
        (moe_layer + attn) * (layers - dense_layers) + (dense_layer + attn) * dense_layers
    ) + _embed_and_head_params(config)
    q_head = cfg(config, "qk_nope_head_dim") + cfg(config, "qk_rope_head_dim")
    # (QK^T over q_head + AV over v_head_dim) * 2 FLOPs * 3 (fwd+bwd) / 2 (causal) = 3 * (q_head + v)
    scores = (
        3
        * _square_sum(seqlens)
        * layers
        * (q_head + cfg(config, "v_head_dim"))
        * cfg(config, "num_attention_heads")
    )
    return 6 * params * sum(seqlens) + scores


def _vision_flops(vision: Any, images_seqlens: Sequence[int] | None) -> int:
    """Qwen3-VL's ViT: conv patch embedding, ``depth`` blocks (plain 2-matrix MLP, 4 ``dim^2``
    projections, bidirectional attention: 12 instead of 6), the patch merger and one merger per
    deepstack layer, each ``(out + dim m^2) * dim m^2`` with ``m`` the spatial merge size."""
    if not images_seqlens or vision is None:
        return 0
    dim, depth, heads = cfg(vision, "hidden_size"), cfg(vision, "depth"), cfg(vision, "num_heads")
    patch = (
        dim * cfg(vision, "in_channels") * cfg(vision, "temporal_patch_size") * cfg(vision, "patch_size") ** 2
    )
    block = 2 * dim * cfg(vision, "intermediate_size") + 4 * dim * dim
    merged = dim * cfg(vision, "spatial_merge_size") ** 2
    merger = (cfg(vision, "out_hidden_size") + merged) * merged
    mergers = merger * (1 + len(cfg(vision, "deepstack_visual_indexes", ())))
    params = patch + block * depth + mergers
    return (
        6 * params * sum(images_seqlens) + 12 * _square_sum(images_seqlens) * (dim // heads) * heads * depth
    )


def _qwen3_vl(config: Any, seqlens: Sequence[int], images_seqlens: Sequence[int] | None = None, **_) -> int:
    text = cfg(config, "text_config")
    return _dense(text, seqlens) + _vision_flops(cfg(config, "vision_config"), images_seqlens)


def _qwen3_vl_moe(
    config: Any, seqlens: Sequence[int], images_seqlens: Sequence[int] | None = None, **_
) -> int:
    text = cfg(config, "text_config")
    return _qwen_moe(text, seqlens) + _vision_flops(cfg(config, "vision_config"), images_seqlens)


DENSE_MODEL_TYPES = frozenset(
    {
        "llama",
        "qwen2",
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3",
        "mistral",
        "minicpmv",
        "minicpmo",
        "seed_oss",
        "glm4v",
        "mimo",
        "gemma3_text",
    }
)  # gemma3_text: GeGLU has 3 matrices too; its sliding layers come from the config

FORMULAS: dict[str, Callable[..., int]] = {
    **dict.fromkeys(DENSE_MODEL_TYPES, _dense),
    "apertus": _apertus,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "qwen3_vl": _qwen3_vl,
    "qwen3_vl_moe": _qwen3_vl_moe,
}


def step_flops(
    config: Any,
    batch_seqlens: Sequence[int],
    images_seqlens: Sequence[int] | None = None,
    model_type: str | None = None,
) -> int:
    """Training FLOPs of sequences with ``batch_seqlens`` real tokens (and, for Qwen3-VL, images of
    ``images_seqlens`` vision tokens) under the formula of ``model_type`` (default: the config's)."""
    kind = model_type or cfg(config, "model_type")
    if kind not in FORMULAS:
        raise KeyError(f"no FLOPs formula for model_type {kind!r}; known: {sorted(FORMULAS)}")
    return FORMULAS[kind](config, list(batch_seqlens), images_seqlens=images_seqlens)
