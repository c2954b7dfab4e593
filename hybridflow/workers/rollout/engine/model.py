"""The engine's own copy of a decoder-only LM: fused weights and a lean forward over a KV cache.

The engine does not call the Hugging Face modules while generating: per-module Python overhead is
most of a decode step on CPU. It holds the weights in a generation layout instead (q/k/v fused into
one matrix, gate/up fused into one) and runs prefill and decode with a handful of tensor ops per
layer. Weights arrive by name from the trainer's module (:meth:`EngineModel.load_weight`), one
parameter at a time, so the hybrid engine never builds a second full state dict.

Supported (:mod:`.layout`: the architecture facts and each family's rules): the Llama family (Llama
2/3, SmolLM2, Mistral), Qwen2/Qwen2.5 (q/k/v bias) and Qwen3 (q/k RMSNorm), the mixtures of experts
Qwen2-MoE, Qwen3-MoE and Mixtral (:mod:`.moe`), Gemma 2 and Gemma 3's text model (softcaps, (1 + w)
norms, sandwich norms, scaled embeddings, Gemma 3's local RoPE), sliding windows where a layer has one
(a mask over the blocks it reads: the pool keeps every position), tied or untied embeddings,
grouped-query attention, and any RoPE variant whose frequencies do not depend on the sequence length;
and Qwen2.5-VL, whose language model the engine holds this way while its vision tower runs as the HF
module (:mod:`.vision`: image features in the prefill's embeddings, M-RoPE positions, decode at a
per-row position offset).

Shapes: B rows in the running batch, L cached positions, H hidden size, nh/nkv query/key-value heads,
hd head dim, V vocabulary. With tensor-parallel generation (:mod:`.parallel`) nh, nkv, the MLP width and
V are this rank's shares: :attr:`EngineModel.spec` is the local layout, ``full_spec`` the model's.
The math follows the HF implementation op for op (RMSNorm in fp32, rotate-half RoPE, scaled softmax
attention), which keeps the engine's log-probs within ~1e-6 of the trainer's full forward in fp32.
"""

from __future__ import annotations

import re
import threading

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.workers.lora import hf_parameter_names, merged_hf_weights, unwrap_peft
from hybridflow.workers.rollout.engine.attention import (
    LayerAttention,
    causal_attention,
    decode_attention,
    decode_masks,
    prefill_attention,
)
from hybridflow.workers.rollout.engine.layout import (  # noqa: F401  (re-exported)
    SUPPORTED_MODEL_TYPES,
    LayerWeights,
    ModelSpec,
    engine_refusal,
    gemma_rms_norm,
    rms_norm,
)
from hybridflow.workers.rollout.engine.moe import moe_mlp
from hybridflow.workers.rollout.engine.parallel import (
    SINGLE,
    GenerationShard,
    gather_last_dim,
    sum_over_group,
    take_shard,
)
from hybridflow.workers.rollout.engine.rope import apply_rope, rope_table, signed_sin  # noqa: F401  (re-exported)
from hybridflow.workers.rollout.engine.vision import VisionTower, mrope_axes
from hybridflow.workers.vision_forward import SUPPRESSED_LOGIT  # a placeholder's logit, as the actor's

_LAYER_NAME = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")


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
        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.full_spec, self.shard = spec, shard
        self.spec = spec.sharded(shard.size)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_positions = rope_cos.shape[0]
        self.rope_cos = rope_cos.to(device=device, dtype=dtype)  # (max_positions, hd)
        self.rope_sin = rope_sin.to(device=device, dtype=dtype)
        self.rope_sin_signed = signed_sin(self.rope_sin)  # what the forwards take (apply_rope)
        # the RoPE tables the layers read, cos and signed sin (max_positions, hd): [global, local]
        self.ropes = [(self.rope_cos, self.rope_sin_signed)]
        if local_rope is not None:  # Gemma 3's sliding layers (LayerWeights.rope = 1)
            cos, sin = (t.to(device=device, dtype=dtype) for t in local_rope)
            self.ropes.append((cos, signed_sin(sin)))
        self.act = _activation(spec.hidden_act)
        # HF's Gemma embedding: times sqrt(H) rounded to the weights' dtype (a 0-dim tensor, as HF's)
        scale = torch.tensor(spec.hidden_size**0.5).to(dtype=dtype, device=device)
        self.embed_scale = scale if spec.gemma else None
        self.attention_options = [  # each layer's scale, softcap and sliding window (:mod:`.attention`)
            LayerAttention(spec.attn_scale, spec.attn_softcap, spec.window(i)) for i in range(spec.num_layers)
        ]
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
        base = unwrap_peft(module)
        cos, sin = rope_table(base, max_positions, "full_attention" if spec.local_rope else None)
        local = rope_table(base, max_positions, "sliding_attention") if spec.local_rope else None
        device = device or _module_device(module)
        return cls(spec, cos, sin, dtype or torch.float32, device, shard, hf_config=config, local_rope=local)

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
        """oneDNN-packed copies of the linear weights (built once after every weight change), except
        fp32 weights of at most :data:`PACK_MIN_ELEMENTS`, which torch's own linear computes faster."""
        with self._pack_lock:
            if self._packed is None:
                weights = [self.lm_head]
                for layer in self.layers:
                    weights += [layer.qkv, layer.o_proj]
                    weights += [] if layer.moe is not None else [layer.gate_up, layer.down]
                weights = [w for w in weights if w.dtype != torch.float32 or w.numel() > PACK_MIN_ELEMENTS]
                self._packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights}
            return self._packed

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` (x: (..., in)), through the packed weight when there is one."""
        if not self.pack_weights:
            return F.linear(x, weight, bias)
        packed = (self._packed if self._packed is not None else self._pack()).get(id(weight))
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
        ``max(lengths) + 1``; None reads it from ``lengths``, which waits for the device); a layer with a
        sliding window reads only its window's keys either way (:attr:`attention_options`). ``record``:
        a list that gets each sparse layer's expert ids (B, k) (:mod:`.routing`)."""
        spec = self.spec
        batch = tokens.shape[0]
        if attention == "gather":
            if span is None:
                span = int(lengths.max()) + 1
            span = -(-span // cache.block_size) * cache.block_size
        elif attention == "kernel":
            table = table.contiguous()
        # the rows' masks (gather) or key ranges (kernel) once per step for every window in use
        windows = {options.window for options in self.attention_options}
        masks = {w: decode_masks(lengths, attention, span, w) for w in windows}
        slots = cache.slots(table, lengths)  # (B,) where each row's new K/V go
        at = lengths if rope_positions is None else rope_positions
        # (B, 1, 1, hd) per table: one query, every head
        ropes = [(cos[at][:, None, None, :], sin[at][:, None, None, :]) for cos, sin in self.ropes]
        x = self._embed(tokens)  # (B, H)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self.norm(x, layer.input_norm), *ropes[layer.rope])
            cache.write(index, slots, k[:, :, 0], v[:, :, 0])
            keys, values = cache.layers[index]
            options = self.attention_options[index]
            hidden = masks[options.window]
            attn = decode_attention(q, keys, values, table, lengths, attention, span, hidden, options)
            x = self._finish_layer(layer, x, attn.reshape(batch, spec.q_size), record)
        return self._logits(self.norm(x, self.final_norm))

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
        n_rows, width = tokens.shape
        device = tokens.device
        offsets = torch.arange(width, device=device)
        starts_t = torch.tensor(starts, device=device)
        positions = starts_t[:, None] + offsets[None, :]  # (P, T)
        valid = offsets[None, :] < lengths[:, None]  # (P, T): real new tokens
        blocks = table.gather(1, (positions // cache.block_size).clamp(max=table.shape[1] - 1))
        slots = (blocks * cache.block_size + positions % cache.block_size)[valid]  # (N,)
        x = self._embed(tokens) if embeds is None else embeds  # (P, T, H)
        # Rows of different lengths: the linear layers, norms and RoPE run on the N real tokens packed
        # into one row (1, N, ...), only attention on the padded (P, T) layout (a 160-token prompt beside
        # seven of 64 computes 608 positions, not 8 x 160). Expert ids are recorded per (P, T).
        packed = record is None and int(lengths.sum()) < n_rows * width
        if packed:
            flat = valid.flatten().nonzero().squeeze(1)  # (N,) real tokens in the padded (P * T) layout
            x = x[valid][None]  # (1, N, H)
        if rope is not None:
            ropes = [tuple(t[valid][None] for t in rope)] if packed else [rope]
        elif packed:  # (1, N, 1, hd) each
            at = positions[valid]
            ropes = [(c[at][None, :, None, :], s[at][None, :, None, :]) for c, s in self.ropes]
        elif max(starts) == 0:
            ropes = [self.rope_at(width, i) for i in range(len(self.ropes))]  # (1, T, 1, hd) each
        else:  # (P, T, 1, hd) each
            ropes = [(c[positions][:, :, None, :], s[positions][:, :, None, :]) for c, s in self.ropes]

        def rows(t: torch.Tensor) -> torch.Tensor:  # (P | 1, heads, T | N, hd) -> (N, heads, hd): real tokens
            return t[0].transpose(0, 1) if packed else t.transpose(1, 2)[valid]

        def padded(t: torch.Tensor) -> torch.Tensor:  # -> (P, heads, T, hd), zeros between packed rows
            if not packed:
                return t
            out = t.new_zeros(n_rows * width, t.shape[1], t.shape[3])
            out[flat] = rows(t)
            return out.view(n_rows, width, t.shape[1], t.shape[3]).transpose(1, 2)

        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self.norm(x, layer.input_norm), *ropes[layer.rope])
            cache.write(index, slots, rows(k), rows(v))
            keys, values = cache.layers[index]
            options = self.attention_options[index]
            attn = prefill_attention(
                padded(q), padded(k), padded(v), keys, values, table, starts_t, max(starts), options
            ).transpose(1, 2)  # (P, T, nh, hd)
            attn = attn.reshape(n_rows * width, -1)[flat][None] if packed else attn.reshape(n_rows, width, -1)
            x = self._finish_layer(layer, x, attn, record)
        if packed:
            last = x[0, lengths.cumsum(0) - 1]  # each row's last token in the packed row
        else:
            last = x[torch.arange(n_rows, device=device), lengths - 1]  # (P, H)
        return self._logits(self.norm(last, self.final_norm))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states (P, T, H) of right-padded ``tokens`` (P, T): the prefill's layers
        without a cache (causal attention over the tokens alone, :func:`.attention.causal_attention`)."""
        n_rows, width = tokens.shape
        ropes = [self.rope_at(width, i) for i in range(len(self.ropes))]  # (1, T, 1, hd) each
        x = self._embed(tokens)  # (P, T, H)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self.norm(x, layer.input_norm), *ropes[layer.rope])
            attn = causal_attention(q, k, v, self.attention_options[index])  # (P, nh, T, hd)
            x = self._finish_layer(layer, x, attn.transpose(1, 2).reshape(n_rows, width, self.spec.q_size))
        return self.norm(x, self.final_norm)

    def rope_at(self, width: int, table: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (1, T, 1, hd) of positions ``0..width-1`` (a prefill's) from RoPE table
        ``table`` (0 global, 1 Gemma 3's local), as :meth:`_qkv` takes them."""
        cos, sin = self.ropes[table]
        return cos[:width][None, :, None, :], sin[:width][None, :, None, :]

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The family's RMSNorm of x (..., H) with weight (H,) (Gemma's ``1 + w``: :mod:`.layout`)."""
        if self.spec.gemma:
            return gemma_rms_norm(x, weight, self.spec.rms_norm_eps)
        return rms_norm(x, weight, self.spec.rms_norm_eps)

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
            q = apply_rope(self.norm(q, layer.q_norm), cos, sin)
            k = apply_rope(self.norm(k, layer.k_norm), cos, sin)
        v = qkv[..., k_end:].view(n, width, spec.num_kv_heads, spec.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _finish_layer(
        self, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor, record=None
    ) -> torch.Tensor:
        """Attention output projection, residual, then the gated MLP and its residual (``record``: a list
        that gets a sparse layer's expert ids, :mod:`.routing`). A Gemma layer normalises the attention's
        and the MLP's outputs before their residuals (``attn_out_norm``, ``mlp_out_norm``)."""
        out = self._row_parallel(attn, layer.o_proj, layer.o_bias)
        x = x + (out if layer.attn_out_norm is None else self.norm(out, layer.attn_out_norm))
        normed = self.norm(x, layer.post_norm)
        if layer.moe is not None:  # a mixture of experts' sparse layer (.moe)
            return x + moe_mlp(normed, layer.moe, self.act, record)
        gate, up = self._linear(normed, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
        out = self._row_parallel(self.act(gate) * up, layer.down, layer.down_bias)
        return x + (out if layer.mlp_out_norm is None else self.norm(out, layer.mlp_out_norm))

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
            x = self.embed[tokens]
        else:
            local = tokens - self.shard.rank * self.spec.vocab_size
            mine = (local >= 0) & (local < self.spec.vocab_size)
            x = self.embed[local.clamp(0, self.spec.vocab_size - 1)] * mine.unsqueeze(-1).to(self.dtype)
            x = sum_over_group(x, self.shard)
        return x if self.embed_scale is None else x * self.embed_scale

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits (..., V) over the whole vocabulary (gathered from the ranks' slices); a
        vision-language model's image/video placeholders at :data:`SUPPRESSED_LOGIT` (never sampled,
        as the actor's log-probs exclude them: :mod:`hybridflow.workers.vision_forward`)."""
        logits = self._linear(h, self.lm_head)
        cap = self.spec.final_softcap
        if cap is not None:  # HF's final logit softcap, in the model's dtype
            logits = torch.tanh(logits / cap) * cap
        logits = gather_last_dim(logits.float(), self.shard)
        if self.suppressed is not None:
            logits.index_fill_(-1, self.suppressed, SUPPRESSED_LOGIT)
        return logits


# fp32 weights up to this many elements run through torch's own linear (MKL), not oneDNN's packed
# one: a packed call costs ~25-30 us before any arithmetic, measured on the 2-core AVX2 EPYC, one thread
# (us per call, packed / torch, at 1, 8, 32 and 128 rows): 256 x 256 weights 32/9, 42/25, 77/60,
# 219/203; 688 x 256 39/19, 68/61, 160/162, 562/541; 256 x 1376 (352k elements) 59/44, 114/133,
# 302/338, 1177/1136, where packing starts to pay. A decode step of a tiny model (hidden 128, 4 layers)
# was 42% packed-linear overhead.
PACK_MIN_ELEMENTS = 2**18


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
