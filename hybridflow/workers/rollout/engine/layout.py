"""The engine's architecture facts and weight layout: :class:`ModelSpec` read from an HF config, one
decoder layer's tensors in generation layout (:class:`LayerWeights`), and each family's rules.

Families (``model_type``): the Llama family (Llama 2/3, SmolLM2, Mistral), Qwen2/Qwen2.5 (q/k/v bias),
Qwen3 (q/k RMSNorm), the mixtures of experts Qwen2-MoE, Qwen3-MoE and Mixtral (:mod:`.moe`), and Gemma 2
and Gemma 3's text model. What Gemma adds, as transformers' ``modeling_gemma2.py`` / ``modeling_gemma3.py``
compute it:

- RMSNorm scaling by ``(1 + w)``, in fp32, cast back after the scale (:func:`gemma_rms_norm`), and four
  norms per layer: ``input_layernorm`` before attention, ``post_attention_layernorm`` on the attention's
  output (before its residual), ``pre_feedforward_layernorm`` before the MLP and
  ``post_feedforward_layernorm`` on the MLP's output (before its residual);
- embeddings times ``sqrt(hidden_size)`` rounded to the model's dtype;
- attention scale ``query_pre_attn_scalar ** -0.5``; Gemma 2's attention logit softcap
  ``cap * tanh(scores / cap)`` (Gemma 3's attention passes none to its kernel even when the config has
  one: nor does the engine), and the final logit softcap on the LM head's output;
- a sliding window on the ``layer_types`` marked ``sliding_attention`` (Gemma 2: every other layer from
  the first; Gemma 3: all but every ``sliding_window_pattern``-th); Gemma 3's sliding layers rotate with
  their own RoPE table (``rope_local_base_freq``, ``rope_parameters["sliding_attention"]``);
- GELU-tanh (``hidden_activation``); Gemma 3 q/k norms are (1 + w) norms too.

A window W (HF's ``sliding_window``) lets the query at position i read keys ``i - W + 1 .. i`` (W keys,
its own included). Mistral and Mixtral with ``sliding_window`` set have it on every layer.

Shapes: H hidden size, nh/nkv query/key-value heads, hd head dim, I the MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hybridflow.workers.rollout.engine.moe import MOE_MODEL_TYPES, MoeSpec, MoeWeights
from hybridflow.workers.rollout.engine.vision import is_vision_language, language_config, weight_prefix

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES, *GEMMA_MODEL_TYPES)
# families whose ``sliding_window`` (when set) covers every layer, as their HF attention reads it
_WINDOW_EVERY_LAYER = ("mistral", "mixtral")
SUPPORT_TABLE = "docs/model_support.md's support table"


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts the engine needs, read from an HF config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    prefix: str = "model."  # where the decoder's parameters live (a vision-language model's language_model)
    mrope_section: tuple[int, ...] | None = None  # a vision-language model's M-RoPE split of hd / 2
    moe: MoeSpec | None = None  # a mixture of experts' layout (:mod:`.moe`); None: every MLP dense
    gemma: bool = False  # (1 + w) norms, the four norms per layer, scaled embeddings (module docstring)
    attn_scale: float | None = None  # the scores' scale; None: hd ** -0.5
    attn_softcap: float | None = None  # attention logit softcap (Gemma 2)
    final_softcap: float | None = None  # final logit softcap (Gemma 2/3)
    windows: tuple[int | None, ...] | None = None  # per layer: its sliding window, or None (full)
    local_rope: bool = False  # sliding layers take the local RoPE table (Gemma 3)

    @classmethod
    def from_hf(cls, config, parameter_names: list[str]) -> ModelSpec:
        """Read the architecture from ``config``; which biases exist from the parameter names (Qwen2
        has q/k/v biases but none on o_proj, Llama's ``attention_bias`` puts one on all four). A
        vision-language model (Qwen2.5-VL) is read from its ``text_config``, a Qwen2 language model."""
        tied = bool(getattr(config, "tie_word_embeddings", False))
        prefix = weight_prefix(config)
        mrope = None
        if is_vision_language(config):
            config = language_config(config)
            mrope = tuple(int(w) for w in config.rope_parameters["mrope_section"])
        first = prefix + "layers.0."
        layer0 = {name[len(first) :] for name in parameter_names if name.startswith(first)}
        model_type = getattr(config, "model_type", None)
        if mrope is not None:
            model_type = "qwen2"  # Qwen2.5-VL's language model is Qwen2's decoder (q/k/v biases)
        raw = dict(config.to_dict(), model_type=model_type)
        refusal = engine_refusal(raw)
        if refusal:
            raise NotImplementedError(refusal)
        heads = int(config.num_attention_heads)
        gemma = model_type in GEMMA_MODEL_TYPES
        windows = sliding_windows(raw)
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            rms_norm_eps=float(config.rms_norm_eps),
            hidden_act=str(getattr(config, "hidden_activation", None) or config.hidden_act),
            qkv_bias="self_attn.q_proj.bias" in layer0,
            o_bias="self_attn.o_proj.bias" in layer0,
            mlp_bias="mlp.gate_proj.bias" in layer0,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            tie_word_embeddings=tied,
            prefix=prefix,
            mrope_section=mrope,
            moe=MoeSpec.from_hf(config, model_type),
            gemma=gemma,
            attn_scale=float(config.query_pre_attn_scalar) ** -0.5 if gemma else None,
            # Gemma 3's attention passes no softcap to its kernel, whatever its config says
            attn_softcap=_cap(config.attn_logit_softcapping) if model_type == "gemma2" else None,
            final_softcap=_cap(getattr(config, "final_logit_softcapping", None)) if gemma else None,
            windows=windows if any(w is not None for w in windows) else None,
            local_rope=model_type == "gemma3_text",
        )

    def sharded(self, size: int) -> ModelSpec:
        """One rank's share of the layout when split ``size`` ways (heads, MLP width, vocabulary)."""
        if size == 1:
            return self
        if self.moe is not None:
            raise NotImplementedError(
                "tensor-parallel generation of a mixture-of-experts model is not implemented (no expert "
                "parallelism): set rollout.tensor_model_parallel_size=1"
            )
        split = ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size")
        bad = [f"{k}={getattr(self, k)}" for k in split if getattr(self, k) % size]
        if bad:
            raise ValueError(f"rollout.tensor_model_parallel_size={size} does not divide {', '.join(bad)}")
        return dataclasses.replace(self, **{k: getattr(self, k) // size for k in split})

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window (keys a query reads, its own included), or None."""
        return None if self.windows is None else self.windows[index]


class LayerWeights:
    """One decoder layer in the generation layout (``F.linear`` weights are (out, in)). ``input_norm``
    (H,) precedes attention and ``post_norm`` (H,) the MLP; a Gemma layer also has ``attn_out_norm`` and
    ``mlp_out_norm`` (H,) on the attention's and the MLP's outputs (module docstring)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, index: int = 0) -> None:
        def empty(*shape):
            return torch.empty(*shape, dtype=dtype, device=device)

        self.window = spec.window(index)  # sliding window, or None
        self.rope = 1 if spec.local_rope and self.window is not None else 0  # which RoPE table it reads
        # a sparse layer of a mixture of experts: its router and experts instead of the dense MLP
        sparse = spec.moe is not None and spec.moe.sparse[index]
        self.moe = MoeWeights(spec.moe, spec.hidden_size, dtype, device) if sparse else None

        qkv_out = spec.q_size + 2 * spec.kv_size
        self.input_norm = empty(spec.hidden_size)
        self.qkv = empty(qkv_out, spec.hidden_size)
        self.qkv_bias = empty(qkv_out) if spec.qkv_bias else None
        self.q_norm = empty(spec.head_dim) if spec.qk_norm else None
        self.k_norm = empty(spec.head_dim) if spec.qk_norm else None
        self.o_proj = empty(spec.hidden_size, spec.q_size)
        self.o_bias = empty(spec.hidden_size) if spec.o_bias else None
        self.post_norm = empty(spec.hidden_size)
        self.attn_out_norm = empty(spec.hidden_size) if spec.gemma else None
        self.mlp_out_norm = empty(spec.hidden_size) if spec.gemma else None
        dense = not sparse
        self.gate_up = empty(2 * spec.intermediate_size, spec.hidden_size) if dense else None
        self.gate_up_bias = empty(2 * spec.intermediate_size) if spec.mlp_bias and dense else None
        self.down = empty(spec.hidden_size, spec.intermediate_size) if dense else None
        self.down_bias = empty(spec.hidden_size) if spec.mlp_bias and dense else None

    def targets(self, spec: ModelSpec) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF parameter suffix -> (engine tensor, first row, end row) it is copied into."""
        q, kv, inter, hidden = spec.q_size, spec.kv_size, spec.intermediate_size, spec.hidden_size
        out = {
            "input_layernorm.weight": (self.input_norm, 0, hidden),
            "self_attn.q_proj.weight": (self.qkv, 0, q),
            "self_attn.k_proj.weight": (self.qkv, q, q + kv),
            "self_attn.v_proj.weight": (self.qkv, q + kv, q + 2 * kv),
            "self_attn.o_proj.weight": (self.o_proj, 0, hidden),
        }
        if self.attn_out_norm is not None:  # Gemma: post_attention_layernorm is on the attention's output
            out["post_attention_layernorm.weight"] = (self.attn_out_norm, 0, hidden)
            out["pre_feedforward_layernorm.weight"] = (self.post_norm, 0, hidden)
            out["post_feedforward_layernorm.weight"] = (self.mlp_out_norm, 0, hidden)
        else:
            out["post_attention_layernorm.weight"] = (self.post_norm, 0, hidden)
        if self.moe is not None:
            out.update(self.moe.targets())
        else:
            out["mlp.gate_proj.weight"] = (self.gate_up, 0, inter)
            out["mlp.up_proj.weight"] = (self.gate_up, inter, 2 * inter)
            out["mlp.down_proj.weight"] = (self.down, 0, hidden)
        if self.qkv_bias is not None:
            out["self_attn.q_proj.bias"] = (self.qkv_bias, 0, q)
            out["self_attn.k_proj.bias"] = (self.qkv_bias, q, q + kv)
            out["self_attn.v_proj.bias"] = (self.qkv_bias, q + kv, q + 2 * kv)
        if self.o_bias is not None:
            out["self_attn.o_proj.bias"] = (self.o_bias, 0, hidden)
        if self.q_norm is not None:
            out["self_attn.q_norm.weight"] = (self.q_norm, 0, spec.head_dim)
            out["self_attn.k_norm.weight"] = (self.k_norm, 0, spec.head_dim)
        if self.gate_up_bias is not None:
            out["mlp.gate_proj.bias"] = (self.gate_up_bias, 0, inter)
            out["mlp.up_proj.bias"] = (self.gate_up_bias, inter, 2 * inter)
            out["mlp.down_proj.bias"] = (self.down_bias, 0, hidden)
        return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, cast back, then scale. fp32 on the CPU: torch's fused
    ``rms_norm`` (one op instead of seven; the same bits, tests/workers/rollout/test_engine.py)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x (..., H) normalised in fp32, times ``1 + weight`` in fp32, then cast back
    (the cast after the scale, unlike :func:`rms_norm`). fp32 on the CPU: torch's fused ``rms_norm``
    with ``1 + weight`` as its weight (the same product)."""
    scale = 1.0 + weight.float()
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return torch.rms_norm(x, (x.shape[-1],), scale, eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def sliding_windows(config: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) of a ``config.json`` dict, as its HF model
    reads it: ``layer_types`` where the family has them (Gemma's default pattern when a config.json
    predates the field), every layer for Mistral/Mixtral with ``sliding_window`` set."""
    model_type, layers = config.get("model_type"), int(config.get("num_hidden_layers") or 0)
    window = config.get("sliding_window")
    if model_type in _WINDOW_EVERY_LAYER:
        return (int(window) if window else None,) * layers
    if model_type not in GEMMA_MODEL_TYPES or not window:
        return (None,) * layers
    types = config.get("layer_types")
    if types is None:  # HF's defaults: Gemma 2 alternates; Gemma 3 has a full layer every `pattern`
        pattern = 2 if model_type == "gemma2" else int(config.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return tuple(int(window) if kind == "sliding_attention" else None for kind in types)


def engine_refusal(config: dict) -> str | None:
    """Why the engine cannot serve a decoder of HF ``config`` (a ``config.json`` dict; a vision-language
    model's text part), or None. Read before Ray starts (the config check) and by :class:`ModelSpec`."""
    model_type = config.get("model_type")
    where = f"{SUPPORT_TABLE} lists each family's backends; use actor_rollout_ref.rollout.name=hf"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"the embedded engine serves {SUPPORTED_MODEL_TYPES}, not model_type={model_type!r} ({where})"
    if config.get("use_sliding_window"):  # the Qwen families' per-layer windows: not built
        return f"the embedded engine has no sliding-window attention for {model_type} ({where})"
    if config.get("use_bidirectional_attention"):
        return f"the embedded engine decodes causally, not {model_type}'s bidirectional attention ({where})"
    return None


def _cap(value) -> float | None:
    return float(value) if value else None
