"""The engine's mixture-of-experts MLP: routing as each family routes, experts computed grouped.

A sparse decoder layer (Qwen2-MoE, Qwen3-MoE, Mixtral; HF's ``is_sparse_layer`` rule,
:mod:`hybridflow.models.moe`) replaces the dense MLP with ``E`` experts and a router:

- **Routing**: router logits (N, E) = ``h @ gate.T``; a softmax in fp32; the top ``k`` experts per
  token; renormalised over those ``k`` where the family does (``norm_topk_prob``; Mixtral always).
  Qwen2/3-MoE cast the weights back to the hidden dtype, Mixtral keeps them in fp32 (as HF does).
- **Experts, grouped**: the (token, expert) pairs are sorted by expert, and each expert that has
  tokens runs one matmul over all of them (gate/up fused (E, 2I, H), down (E, H, I): transformers'
  fused expert weights), weighted and added into the output in expert order, as HF accumulates.
- **Qwen2-MoE's shared expert**: a dense SwiGLU MLP on every token, scaled by ``sigmoid(h @
  shared_expert_gate.T)``, added after the routed experts.

Shapes: N tokens, H hidden, E experts, k experts per token, I expert width, Is shared-expert width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class MoeSpec:
    """A model's expert layout, read from its HF config."""

    num_experts: int
    top_k: int
    expert_size: int  # I
    shared_size: int  # Is (0: no shared expert)
    normalize: bool  # renormalise the top-k weights
    fp32_weights: bool  # keep the routing weights in fp32 (Mixtral)
    sparse: tuple[bool, ...]  # per decoder layer: routed experts, or the dense MLP

    @classmethod
    def from_hf(cls, config, model_type: str) -> MoeSpec | None:
        """None for a dense model."""
        from hybridflow.models.moe import is_sparse_layer

        if model_type not in MOE_MODEL_TYPES:
            return None
        mixtral = model_type == "mixtral"
        experts = int(config.num_local_experts if mixtral else config.num_experts)
        return cls(
            num_experts=experts,
            top_k=int(config.num_experts_per_tok),
            expert_size=int(config.intermediate_size if mixtral else config.moe_intermediate_size),
            shared_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
            normalize=mixtral or bool(getattr(config, "norm_topk_prob", False)),
            fp32_weights=mixtral,
            sparse=tuple(is_sparse_layer(config, i) for i in range(int(config.num_hidden_layers))),
        )


class MoeWeights:
    """One sparse layer's router, experts and (Qwen2-MoE) shared expert, in the generation layout."""

    def __init__(self, spec: MoeSpec, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        def empty(*shape):
            return torch.empty(*shape, dtype=dtype, device=device)

        experts, width = spec.num_experts, spec.expert_size
        self.spec = spec
        self.router = empty(experts, hidden)
        self.gate_up = empty(experts, 2 * width, hidden)
        self.down = empty(experts, hidden, width)
        shared = spec.shared_size
        self.shared_gate_up = empty(2 * shared, hidden) if shared else None
        self.shared_down = empty(hidden, shared) if shared else None
        self.shared_gate = empty(1, hidden) if shared else None

    def targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF parameter suffix -> (engine tensor, first row, end row) it is copied into."""
        out = {
            "mlp.gate.weight": (self.router, 0, self.spec.num_experts),
            "mlp.experts.gate_up_proj": (self.gate_up, 0, self.spec.num_experts),
            "mlp.experts.down_proj": (self.down, 0, self.spec.num_experts),
        }
        shared = self.spec.shared_size
        if shared:
            out["mlp.shared_expert.gate_proj.weight"] = (self.shared_gate_up, 0, shared)
            out["mlp.shared_expert.up_proj.weight"] = (self.shared_gate_up, shared, 2 * shared)
            out["mlp.shared_expert.down_proj.weight"] = (self.shared_down, 0, self.shared_down.shape[0])
            out["mlp.shared_expert_gate.weight"] = (self.shared_gate, 0, 1)
        return out


def route(h: torch.Tensor, weights: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """h (N, H) → (routing weights (N, k), expert ids (N, k)), as the family's HF router computes them."""
    spec = weights.spec
    logits = F.linear(h, weights.router)  # (N, E)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top if spec.fp32_weights else top.to(logits.dtype)), experts


def moe_mlp(h: torch.Tensor, weights: MoeWeights, act, record: list | None = None) -> torch.Tensor:
    """The sparse layer's MLP output (..., H) for post-norm hidden states h (..., H). ``record``: a list
    that gets this layer's expert ids (..., k) (router replay's recording, :mod:`.routing`)."""
    shape = h.shape
    flat = h.reshape(-1, shape[-1])
    top, experts = route(flat, weights)
    k = experts.shape[1]
    if record is not None:
        record.append(experts.view(*shape[:-1], k))
    order = torch.argsort(experts.reshape(-1), stable=True)  # (N * k,) pairs grouped by expert
    counts = torch.bincount(experts.reshape(-1), minlength=weights.spec.num_experts).tolist()
    tokens, slots = order // k, order % k
    out = torch.zeros_like(flat)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows, picks = tokens[start : start + count], slots[start : start + count]
        start += count
        gate, up = F.linear(flat[rows], weights.gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, weights.down[expert]) * top[rows, picks, None]
        out.index_add_(0, rows, y.to(out.dtype))
    if weights.shared_gate_up is not None:
        gate, up = F.linear(flat, weights.shared_gate_up).chunk(2, dim=-1)
        shared = F.linear(act(gate) * up, weights.shared_down)
        out = out + torch.sigmoid(F.linear(flat, weights.shared_gate)) * shared
    return out.view(shape)
