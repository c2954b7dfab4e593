"""The engine's own copy of a decoder-only LM: fused weights and a lean forward over a KV cache.

The engine does not call the Hugging Face modules while generating: per-module Python overhead is
most of a decode step on CPU. It holds the weights in a generation layout instead (q/k/v fused into
one matrix, gate/up fused into one) and runs prefill and decode with a handful of tensor ops per
layer. Weights arrive by name from the trainer's module (:meth:`EngineModel.load_weight`), one
parameter at a time, so the hybrid engine never builds a second full state dict.

Supported: the Llama family (Llama 2/3, SmolLM2, Mistral without sliding window), Qwen2/Qwen2.5
(q/k/v bias) and Qwen3 (q/k RMSNorm), the mixtures of experts Qwen2-MoE, Qwen3-MoE and Mixtral
(:mod:`.moe`), tied or untied embeddings, grouped-query attention, and any
RoPE variant whose frequencies do not depend on the sequence length; and Qwen2.5-VL, whose language
model the engine holds this way while its vision tower runs as the HF module (:mod:`.vision`: image
features in the prefill's embeddings, M-RoPE positions, decode at a per-row position offset).

Shapes: B rows in the running batch, L cached positions, H hidden size, nh/nkv query/key-value heads,
hd head dim, V vocabulary. With tensor-parallel generation (:mod:`.parallel`) nh, nkv, the MLP width and
V are this rank's shares: :attr:`EngineModel.spec` is the local layout, ``full_spec`` the model's.
The math follows the HF implementation op for op (RMSNorm in fp32, rotate-half RoPE, scaled softmax
attention), which keeps the engine's log-probs within ~1e-6 of the trainer's full forward in fp32.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.workers.lora import hf_parameter_names, merged_hf_weights, unwrap_peft
from hybridflow.workers.rollout.engine.attention import decode_attention, prefill_attention, span_hidden
from hybridflow.workers.rollout.engine.moe import MOE_MODEL_TYPES, MoeSpec, MoeWeights, moe_mlp
from hybridflow.workers.rollout.engine.parallel import (
    SINGLE,
    GenerationShard,
    gather_last_dim,
    sum_over_group,
    take_shard,
)
from hybridflow.workers.rollout.engine.rope import apply_rope, rope_table, signed_sin  # noqa: F401  (re-exported)
from hybridflow.workers.rollout.engine.vision import (
    VisionTower,
    is_vision_language,
    language_config,
    mrope_axes,
    weight_prefix,
)
from hybridflow.workers.vision_forward import SUPPRESSED_LOGIT  # a placeholder's logit, as the actor's

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
_LAYER_NAME = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")


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
        refusal = engine_refusal(dict(config.to_dict(), model_type=model_type))
        if refusal:
            raise NotImplementedError(refusal)
        heads = int(config.num_attention_heads)
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            rms_norm_eps=float(config.rms_norm_eps),
            hidden_act=str(config.hidden_act),
            qkv_bias="self_attn.q_proj.bias" in layer0,
            o_bias="self_attn.o_proj.bias" in layer0,
            mlp_bias="mlp.gate_proj.bias" in layer0,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=tied,
            prefix=prefix,
            mrope_section=mrope,
            moe=MoeSpec.from_hf(config, model_type),
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


class LayerWeights:
    """One decoder layer in the generation layout (``F.linear`` weights are (out, in))."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, index: int = 0) -> None:
        def empty(*shape):
            return torch.empty(*shape, dtype=dtype, device=device)

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
        dense = not sparse
        self.gate_up = empty(2 * spec.intermediate_size, spec.hidden_size) if dense else None
        self.gate_up_bias = empty(2 * spec.intermediate_size) if spec.mlp_bias and dense else None
        self.down = empty(spec.hidden_size, spec.intermediate_size) if dense else None
        self.down_bias = empty(spec.hidden_size) if spec.mlp_bias and dense else None

    def targets(self, spec: ModelSpec) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF parameter suffix -> (engine tensor, first row, end row) it is copied into."""
        q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
        out = {
            "input_layernorm.weight": (self.input_norm, 0, spec.hidden_size),
            "self_attn.q_proj.weight": (self.qkv, 0, q),
            "self_attn.k_proj.weight": (self.qkv, q, q + kv),
            "self_attn.v_proj.weight": (self.qkv, q + kv, q + 2 * kv),
            "self_attn.o_proj.weight": (self.o_proj, 0, spec.hidden_size),
            "post_attention_layernorm.weight": (self.post_norm, 0, spec.hidden_size),
        }
        if self.moe is not None:
            out.update(self.moe.targets())
        else:
            out["mlp.gate_proj.weight"] = (self.gate_up, 0, inter)
            out["mlp.up_proj.weight"] = (self.gate_up, inter, 2 * inter)
            out["mlp.down_proj.weight"] = (self.down, 0, spec.hidden_size)
        if self.qkv_bias is not None:
            out["self_attn.q_proj.bias"] = (self.qkv_bias, 0, q)
            out["self_attn.k_proj.bias"] = (self.qkv_bias, q, q + kv)
            out["self_attn.v_proj.bias"] = (self.qkv_bias, q + kv, q + 2 * kv)
        if self.o_bias is not None:
            out["self_attn.o_proj.bias"] = (self.o_bias, 0, spec.hidden_size)
        if self.q_norm is not None:
            out["self_attn.q_norm.weight"] = (self.q_norm, 0, spec.head_dim)
            out["self_attn.k_norm.weight"] = (self.k_norm, 0, spec.head_dim)
        if self.gate_up_bias is not None:
            out["mlp.gate_proj.bias"] = (self.gate_up_bias, 0, inter)
            out["mlp.up_proj.bias"] = (self.gate_up_bias, inter, 2 * inter)
            out["mlp.down_proj.bias"] = (self.down_bias, 0, spec.hidden_size)
        return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, cast back, then scale. fp32 on the CPU: torch's fused
    ``rms_norm`` (one op instead of seven; the same bits, tests/workers/rollout/test_engine.py)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class EngineModel:
    """Weights in generation layout plus prefill/decode forwards that read and write a KV cache.

    Build with :meth:`from_hf_module` (copies the weights now) or :meth:`empty_like_hf_module`
    (allocates only; fill with :meth:`load_weight`). ``shard``: this rank's place in a tensor-parallel
    generation group (:mod:`.parallel`); every rank of the group runs the same forwards."""

    def __init__(
        self,
        spec: ModelSpec,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        dtype,
        device,
        shard: GenerationShard = SINGLE,
        hf_config=None,
    ) -> None:
        self.full_spec, self.shard = spec, shard
        self.spec = spec.sharded(shard.size)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_positions = rope_cos.shape[0]
        self.rope_cos = rope_cos.to(device=device, dtype=dtype)  # (max_positions, hd)
        self.rope_sin = rope_sin.to(device=device, dtype=dtype)
        self.rope_sin_signed = signed_sin(self.rope_sin)  # what the forwards take (apply_rope)
        self.act = _activation(spec.hidden_act)
        # CPU: linear weights also kept in oneDNN's packed layout (what vLLM-CPU does; 2-3x the fp32
        # GEMM throughput of torch.mm at decode batch sizes), rebuilt after any weight changes
        self.pack_weights = packing_available(self.device, dtype)
        self._packed: dict[int, torch.Tensor] | None = None
        self._pack_lock = threading.Lock()
        # a vision-language model: its vision tower (HF module), M-RoPE axes, placeholders never sampled
        # bumped by every weight change (load_weight, a re-allocation): the engines flush their prefix
        # caches when it moves, so keys and values computed with old weights are never reused
        self.weights_version = 0
        self.vision: VisionTower | None = None
        self.mrope_axes: torch.Tensor | None = None
        self.suppressed: torch.Tensor | None = None  # (k,) token ids
        if spec.mrope_section is not None:
            if shard.parallel:
                raise NotImplementedError(
                    "tensor-parallel generation of a vision-language model is not implemented (the vision "
                    "tower is not split): set rollout.tensor_model_parallel_size=1"
                )
            self.vision = VisionTower(hf_config, dtype, self.device)
            self.mrope_axes = mrope_axes(spec.mrope_section, spec.head_dim).to(self.device)
            ids = [self.vision.image_token_id, self.vision.video_token_id]
            self.suppressed = torch.tensor([int(i) for i in ids if i is not None], device=self.device)
        self.allocate()
        self._shapes = {
            name: (end - start, *target.shape[1:]) for name, (target, start, end) in self._targets.items()
        }

    @property
    def allocated(self) -> bool:
        return bool(self._targets)

    def allocate(self) -> None:
        """(Re-)create the weight tensors, uninitialised: a sync fills them."""
        if getattr(self, "_targets", None):
            return
        spec, dtype, device = self.spec, self.dtype, self.device
        self.embed = torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = [LayerWeights(spec, dtype, device, i) for i in range(spec.num_layers)]
        self.final_norm = torch.empty(spec.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed if spec.tie_word_embeddings else torch.empty_like(self.embed)
        if self.vision is not None:
            self.vision.allocate()
        self._targets = self._build_targets()
        self.weights_version += 1

    def release(self) -> None:
        """Drop every weight tensor (between rollouts: no second copy of the model while training)."""
        self.embed = self.lm_head = self.final_norm = None
        self.layers, self._targets = [], {}
        self._packed = None
        if self.vision is not None:
            self.vision.release()

    # ------------------------------------------------------------------ construction
    @classmethod
    def empty_like_hf_module(
        cls,
        module: nn.Module,
        max_positions: int,
        dtype: torch.dtype | None = None,
        device=None,
        shard: GenerationShard = SINGLE,
    ) -> EngineModel:
        """Allocate an engine for ``module``'s architecture (weights uninitialised); a peft-wrapped
        module counts as its base model."""
        config = unwrap_peft(module).config
        spec = ModelSpec.from_hf(config, hf_parameter_names(module))
        cos, sin = rope_table(unwrap_peft(module), max_positions)
        device = device or _module_device(module)
        return cls(spec, cos, sin, dtype or torch.float32, device, shard, hf_config=config)

    @classmethod
    def from_hf_module(
        cls, module: nn.Module, max_positions: int, dtype=None, device=None, shard: GenerationShard = SINGLE
    ) -> EngineModel:
        """An engine holding a copy of ``module``'s (unsharded, LoRA-merged) weights, or of this
        rank's share of them with a ``shard``."""
        from hybridflow.workers.rollout.engine.weight_sync import WeightLedger

        engine = cls.empty_like_hf_module(module, max_positions, dtype, device, shard)
        named = [(name, tensor.detach()) for name, tensor in module.named_parameters()]
        ledger = WeightLedger(engine)
        for name, tensor in merged_hf_weights(module, named):
            part = take_shard(name, tensor, shard)
            if ledger.accept(name, part):
                engine.load_weight(name, part)
        ledger.check()
        return engine

    def _build_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        spec, prefix = self.spec, self.spec.prefix
        targets = {
            f"{prefix}embed_tokens.weight": (self.embed, 0, spec.vocab_size),
            f"{prefix}norm.weight": (self.final_norm, 0, spec.hidden_size),
        }
        if not spec.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head, 0, spec.vocab_size)
        for i, layer in enumerate(self.layers):
            for suffix, target in layer.targets(spec).items():
                targets[f"{prefix}layers.{i}.{suffix}"] = target
        if self.vision is not None:
            targets.update(self.vision.targets())
        return targets

    @property
    def weight_names(self) -> list[str]:
        """HF parameter names the engine expects, each exactly once per full sync."""
        return list(self._targets)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF parameter name -> the shape :meth:`load_weight` expects for it (this rank's share)."""
        return dict(self._shapes)

    @property
    def ignored_weight_names(self) -> frozenset[str]:
        """Names a sync may send that have no place of their own (a tied ``lm_head`` is the embedding)."""
        return frozenset({"lm_head.weight"}) if self.spec.tie_word_embeddings else frozenset()

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one HF parameter (this rank's share of it: :meth:`weight_shapes`) into its place."""
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            return  # tied: the embedding already holds it
        region = self.target(name)
        if region.shape != tensor.shape:
            raise ValueError(
                f"parameter {name!r}: engine expects {tuple(region.shape)}, got {tuple(tensor.shape)}"
            )
        region.copy_(tensor)
        self._packed = None  # the packed copies are stale now
        self.weights_version += 1

    def _pack(self) -> dict[int, torch.Tensor]:
        """oneDNN-packed copies of the linear weights (built once after every weight change)."""
        with self._pack_lock:
            if self._packed is None:
                weights = [self.lm_head]
                for layer in self.layers:
                    weights += [layer.qkv, layer.o_proj]
                    weights += [] if layer.moe is not None else [layer.gate_up, layer.down]
                self._packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights}
            return self._packed

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` (x: (..., in)), through the packed weight when there is one."""
        if not self.pack_weights:
            return F.linear(x, weight, bias)
        packed = (self._packed or self._pack()).get(id(weight))
        if packed is None:
            return F.linear(x, weight, bias)
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [None], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def target(self, name: str) -> torch.Tensor:
        """The engine's tensor region (a view) that HF parameter ``name`` fills (allocates released
        weights first)."""
        self.allocate()
        try:
            target, start, end = self._targets[name]
        except KeyError:
            raise KeyError(f"engine has no place for parameter {name!r} ({_describe_layer(name)})") from None
        return target[start:end]

    def parameter_bytes(self) -> int:
        seen, total = set(), 0
        for tensor, _, _ in self._targets.values():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
        return total

    # ------------------------------------------------------------------ forward
    def decode(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        cache,
        table: torch.Tensor,
        span: int | None = None,
        attention: str = "gather",
        rope_positions: torch.Tensor | None = None,
        record: list | None = None,
    ) -> torch.Tensor:
        """One new token per row. tokens, lengths (B,): the token at position ``lengths[b]`` of row b,
        whose blocks are ``table[b]`` (B, W) of the paged ``cache`` (:mod:`.kv_cache`). Writes its K/V
        and returns fp32 logits (B, V). ``rope_positions`` (B,): the rotary position of each token when
        it is not ``lengths`` (an image prompt's row: ``lengths + rope_delta``, :mod:`.vision`).
        ``attention`` (:mod:`.attention`): ``"kernel"`` reads each row's valid keys in place (CPU);
        ``"gather"`` reads the first ``span`` positions of each row's table (``span``: at least
        ``max(lengths) + 1``; None reads it from ``lengths``, which waits for the device). ``record``:
        a list that gets each sparse layer's expert ids (B, k) (:mod:`.routing`)."""
        spec = self.spec
        batch = tokens.shape[0]
        hidden = None
        if attention == "gather":
            if span is None:
                span = int(lengths.max()) + 1
            span = -(-span // cache.block_size) * cache.block_size
            hidden = span_hidden(lengths, span)  # the rows' masks once for every layer
        elif attention == "kernel":
            hidden = (lengths + 1).contiguous()  # the keys each row reads, once for every layer
            table = table.contiguous()
        slots = cache.slots(table, lengths)  # (B,) where each row's new K/V go
        at = lengths if rope_positions is None else rope_positions
        cos = self.rope_cos[at][:, None, None, :]  # (B, 1, 1, hd): one query, every head
        sin = self.rope_sin_signed[at][:, None, None, :]
        x = self._embed(tokens)  # (B, H)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, rms_norm(x, layer.input_norm, spec.rms_norm_eps), cos, sin)
            cache.write(index, slots, k[:, :, 0], v[:, :, 0])
            keys, values = cache.layers[index]
            attn = decode_attention(q, keys, values, table, lengths, attention, span, hidden)
            x = self._finish_layer(layer, x, attn.reshape(batch, spec.q_size), record)
        return self._logits(rms_norm(x, self.final_norm, spec.rms_norm_eps))

    def prefill(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        cache,
        table: torch.Tensor,
        starts: list[int],
        embeds: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        record: list | None = None,
    ) -> torch.Tensor:
        """New tokens of P sequences, each after its cached prefix. tokens (P, T) right-padded, lengths
        (P,) new tokens per row, starts (P,) host ints: positions already in the cache (row p's tokens
        go to positions ``starts[p]..``, whole blocks cached, :mod:`.block_pool`); table (P, W) each
        row's blocks. Writes the new K/V and returns fp32 logits (P, V) at each row's last token. Right
        padding never leaks into a real token under the causal mask. Image prompts
        (:func:`.vision.image_prefill_inputs`): ``embeds`` (P, T, H) instead of the tokens'
        embeddings, ``rope`` cos and signed sin (P, T, 1, hd) at the new tokens' positions. ``record``:
        a list that gets each sparse layer's expert ids (P, T, k) (:mod:`.routing`)."""
        spec = self.spec
        n_rows, width = tokens.shape
        device = tokens.device
        offsets = torch.arange(width, device=device)
        starts_t = torch.tensor(starts, device=device)
        positions = starts_t[:, None] + offsets[None, :]  # (P, T)
        if rope is not None:
            cos, sin = rope
        elif max(starts) == 0:
            cos, sin = self.rope_at(width)  # (1, T, 1, hd)
        else:
            cos = self.rope_cos[positions][:, :, None, :]  # (P, T, 1, hd)
            sin = self.rope_sin_signed[positions][:, :, None, :]
        valid = offsets[None, :] < lengths[:, None]  # (P, T): real new tokens
        blocks = table.gather(1, (positions // cache.block_size).clamp(max=table.shape[1] - 1))
        slots = (blocks * cache.block_size + positions % cache.block_size)[valid]  # (N,)
        x = self._embed(tokens) if embeds is None else embeds  # (P, T, H)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, rms_norm(x, layer.input_norm, spec.rms_norm_eps), cos, sin)
            cache.write(index, slots, k.transpose(1, 2)[valid], v.transpose(1, 2)[valid])
            keys, values = cache.layers[index]
            attn = prefill_attention(q, k, v, keys, values, table, starts_t, max(starts))  # (P, nh, T, hd)
            x = self._finish_layer(layer, x, attn.transpose(1, 2).reshape(n_rows, width, spec.q_size), record)
        last = x[torch.arange(n_rows, device=device), lengths - 1]  # (P, H)
        return self._logits(rms_norm(last, self.final_norm, spec.rms_norm_eps))

    def rope_at(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (1, T, 1, hd) of positions ``0..width-1`` (a prefill's), as
        :meth:`_qkv` takes them."""
        return self.rope_cos[:width][None, :, None, :], self.rope_sin_signed[:width][None, :, None, :]

    def _qkv(self, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h (..., H) → q (N, nh, T, hd), k and v (N, nkv, T, hd) with RoPE applied (T = 1 in decode).
        cos and sin (N | 1, T, 1, hd): ``rope_cos`` and ``rope_sin_signed`` at the positions."""
        spec = self.spec
        qkv = self._linear(h, layer.qkv, layer.qkv_bias)
        if qkv.dim() == 2:
            qkv = qkv.unsqueeze(1)  # decode: (B, 1, ...)
        n, width = qkv.shape[:2]
        q_end, k_end = spec.q_size, spec.q_size + spec.kv_size
        if layer.q_norm is None:  # q and k side by side in qkv: rotated together, one op each
            qk = qkv[..., :k_end].view(n, width, spec.num_heads + spec.num_kv_heads, spec.head_dim)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :, : spec.num_heads], qk[:, :, spec.num_heads :]
        else:
            q = qkv[..., :q_end].view(n, width, spec.num_heads, spec.head_dim)
            k = qkv[..., q_end:k_end].view(n, width, spec.num_kv_heads, spec.head_dim)
            q = apply_rope(rms_norm(q, layer.q_norm, spec.rms_norm_eps), cos, sin)
            k = apply_rope(rms_norm(k, layer.k_norm, spec.rms_norm_eps), cos, sin)
        v = qkv[..., k_end:].view(n, width, spec.num_kv_heads, spec.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _finish_layer(
        self, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor, record=None
    ) -> torch.Tensor:
        """Attention output projection, residual, then the gated MLP and its residual (``record``: a list
        that gets a sparse layer's expert ids, :mod:`.routing`)."""
        spec = self.spec
        x = x + self._row_parallel(attn, layer.o_proj, layer.o_bias)
        if layer.moe is not None:  # a mixture of experts' sparse layer (.moe)
            normed = rms_norm(x, layer.post_norm, spec.rms_norm_eps)
            return x + moe_mlp(normed, layer.moe, self.act, record)
        gate, up = self._linear(
            rms_norm(x, layer.post_norm, spec.rms_norm_eps), layer.gate_up, layer.gate_up_bias
        ).chunk(2, dim=-1)
        return x + self._row_parallel(self.act(gate) * up, layer.down, layer.down_bias)

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` where x and weight hold this rank's share of the inner dimension:
        the partial products are summed over the group, and the bias is added once after the sum."""
        if not self.shard.parallel:
            return self._linear(x, weight, bias)
        out = sum_over_group(self._linear(x, weight), self.shard)
        return out if bias is None else out + bias

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings (..., H) of full-vocabulary ``tokens`` (...): with a vocabulary slice per rank,
        each looks up its own tokens (zeros for the rest) and the group sums."""
        if not self.shard.parallel:
            return self.embed[tokens]
        local = tokens - self.shard.rank * self.spec.vocab_size
        mine = (local >= 0) & (local < self.spec.vocab_size)
        x = self.embed[local.clamp(0, self.spec.vocab_size - 1)] * mine.unsqueeze(-1).to(self.dtype)
        return sum_over_group(x, self.shard)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits (..., V) over the whole vocabulary (gathered from the ranks' slices); a
        vision-language model's image/video placeholders at :data:`SUPPRESSED_LOGIT` (never sampled,
        as the actor's log-probs exclude them: :mod:`hybridflow.workers.vision_forward`)."""
        logits = gather_last_dim(self._linear(h, self.lm_head).float(), self.shard)
        if self.suppressed is not None:
            logits.index_fill_(-1, self.suppressed, SUPPRESSED_LOGIT)
        return logits


def engine_refusal(config: dict) -> str | None:
    """Why the engine cannot serve a decoder of HF ``config`` (a ``config.json`` dict; a vision-language
    model's text part), or None. Read before Ray starts (the config check) and by :class:`ModelSpec`."""
    model_type = config.get("model_type")
    where = "docs/model_support.md lists each family's backends; use actor_rollout_ref.rollout.name=hf"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"the embedded engine serves {SUPPORTED_MODEL_TYPES}, not model_type={model_type!r} ({where})"
    windowed = model_type in ("mistral", "mixtral") and config.get("sliding_window")
    if config.get("use_sliding_window") or windowed:
        return f"the embedded engine has no sliding-window attention ({model_type}; {where})"
    return None


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed linear on this CPU for ``dtype`` (fp32; bf16 where the CPU computes it fast).
    ``HYBRIDFLOW_ENGINE_PACKED=0`` turns it off (torch.mm, as before)."""
    import os

    if device.type != "cpu" or os.environ.get("HYBRIDFLOW_ENGINE_PACKED", "1") == "0":
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    from hybridflow.utils.device import has_fast_bf16

    return dtype == torch.float32 or (dtype == torch.bfloat16 and has_fast_bf16("cpu"))


def _activation(name: str):
    if name == "silu":  # HF's SiLU module calls this: the same kernel, no module call per layer
        return F.silu
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise NotImplementedError(f"unknown hidden_act {name!r}")
    return ACT2FN[name]


def _module_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        return local.device
    return torch.device("cpu")


def _describe_layer(name: str) -> str:
    match = _LAYER_NAME.match(name)
    return f"layer {match.group(1)}, {match.group(2)}" if match else "not a decoder-layer parameter"
