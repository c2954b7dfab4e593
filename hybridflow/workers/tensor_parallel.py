"""Tensor parallelism for the training models (HybridFlow §5's training layout, Megatron-style splits).

A worker group of ``world`` processes trains on a 2-D device mesh ``(dp, tp)``: rank ``r`` is data-parallel
rank ``r // tp`` and tensor-parallel rank ``r % tp`` (a TP group is ``tp`` consecutive ranks). Inside a TP
group every rank sees the same batch and holds a slice of each matrix, expressed as DTensor placements:

- attention: q/k/v column-parallel (each rank owns ``nh / tp`` query and ``nkv / tp`` key/value heads),
  o_proj row-parallel (its output is all-reduced);
- MLP: gate/up column-parallel, down row-parallel (output all-reduced);
- embedding: vocabulary-parallel (each rank owns ``V / tp`` rows; the masked lookup is all-reduced);
- LM head: column-parallel over the vocabulary, output kept sharded: each rank holds the logits of its
  ``V / tp`` tokens, and log-probs/entropy come from a parallel log-softmax
  (:func:`vocab_parallel_log_probs`) that never gathers the (b, T, V) logits;
- norms and a value head are replicated DTensors (their gradient is the same on every TP rank).

FSDP2 (``fully_shard``) then shards every parameter along dim 0 over the ``dp`` sub-mesh. The loss is
computed identically on all ranks of a TP group, so no gradient is counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# HF parameter suffix -> the dim it is split along (0: output rows, 1: input columns); others are replicated.
SPLIT_DIMS = {
    "embed_tokens.weight": 0,
    "lm_head.weight": 0,
    "self_attn.q_proj.weight": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.bias": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.gate_proj.bias": 0,
    "mlp.up_proj.bias": 0,
    "mlp.down_proj.weight": 1,
}


def split_dim(name: str) -> int | None:
    """The dim along which the tensor-parallel layout splits HF parameter ``name`` (None: replicated)."""
    for suffix, dim in SPLIT_DIMS.items():
        if name == suffix or name.endswith("." + suffix):
            return dim
    return None


@dataclass(frozen=True)
class TensorParallelState:
    """What a TP-sharded model needs at run time: its TP and DP process groups and its vocabulary slice."""

    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    vocab_start: int  # this rank's LM-head rows are the tokens [vocab_start, vocab_end)
    vocab_end: int


_STATE_ATTR = "_hybridflow_tensor_parallel"


def tensor_parallel_state(model: nn.Module) -> TensorParallelState | None:
    """The state :func:`apply_tensor_parallel` attached to ``model`` (None: not tensor-parallel)."""
    from hybridflow.workers.lora import unwrap_peft

    return getattr(unwrap_peft(model), _STATE_ATTR, None)


def dp_group_of(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group a model's loss is normalised over: its dp ranks (None: the whole world)."""
    state = tensor_parallel_state(model)
    return state.dp_group if state is not None else None


def divisibility_problems(config, tp: int) -> list[str]:
    """Why an HF ``config`` cannot be split ``tp`` ways (empty: it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in TP_MODEL_TYPES:
        return [f"tensor parallelism supports model_type {TP_MODEL_TYPES}, not {model_type!r}"]
    heads = int(config.num_attention_heads)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "intermediate_size": int(config.intermediate_size),
        "vocab_size": int(config.vocab_size),
    }
    return [
        f"{key}={value} is not divisible by tensor_model_parallel_size={tp}"
        for key, value in sizes.items()
        if value % tp
    ]


class ReplicateParallel(ParallelStyle):
    """A module whose parameters every TP rank holds whole (a norm, a value head): they become Replicate
    DTensors, so FSDP2 and gradient clipping see one 2-D mesh; inputs and outputs stay plain tensors.
    ``input_layout`` says how the input is laid out over the TP ranks: Replicate for the hidden states,
    ``Shard(2)`` for per-head tensors (b, T, nh / tp, hd) such as Qwen3's q/k norms, whose weight
    gradient is then summed over the ranks' heads."""

    def __init__(self, input_layout=None) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.input_layout

        def to_dtensor(_module, inputs, mesh):
            def wrap(x):
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                    return DTensor.from_local(x, mesh, [layout], run_check=False)
                return x

            return tuple(wrap(x) for x in inputs)

        def to_local(_module, output, _mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


def _plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The TP plan of an HF Llama/Qwen2/Qwen3 causal LM or token classifier, by module path."""
    layers = "model.layers.*"
    plan: dict[str, ParallelStyle] = {
        # vocabulary-parallel embedding: masked lookup of the local rows, then an all-reduce
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.norm": ReplicateParallel(),
        f"{layers}.input_layernorm": ReplicateParallel(),
        f"{layers}.post_attention_layernorm": ReplicateParallel(),
        f"{layers}.self_attn.q_proj": ColwiseParallel(),
        f"{layers}.self_attn.k_proj": ColwiseParallel(),
        f"{layers}.self_attn.v_proj": ColwiseParallel(),
        f"{layers}.self_attn.o_proj": RowwiseParallel(),
        f"{layers}.mlp.gate_proj": ColwiseParallel(),
        f"{layers}.mlp.up_proj": ColwiseParallel(),
        f"{layers}.mlp.down_proj": RowwiseParallel(),
    }
    if getattr(model.config, "model_type", None) == "qwen3":
        # per-head norms of (b, T, heads, hd): each rank normalises its own heads
        plan[f"{layers}.self_attn.q_norm"] = ReplicateParallel(Shard(2))
        plan[f"{layers}.self_attn.k_norm"] = ReplicateParallel(Shard(2))
    if hasattr(model, "lm_head"):
        # the logits stay sharded over the vocabulary: vocab_parallel_log_probs reads them as they are
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    if hasattr(model, "score"):
        plan["score"] = ReplicateParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split ``model`` over ``mesh["tp"]`` in place (see the module docstring) and record the groups.

    ``mesh`` is the 2-D ``(dp, tp)`` mesh. Raises ValueError when the architecture is not supported or
    its sizes do not divide; RuntimeError when a parameter is left outside the plan (an unknown module)."""
    tp_mesh, tp = mesh["tp"], mesh["tp"].size()
    problems = divisibility_problems(model.config, tp)
    if problems:
        raise ValueError("tensor parallelism: " + "; ".join(problems))
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) and hasattr(model, "lm_head")
    parallelize_module(model, tp_mesh, _plan(model))
    if tied:  # each module was distributed on its own: tie the LM head to the (identically sharded) embedding
        model.lm_head.weight = model.model.embed_tokens.weight
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"tensor parallelism: no plan for parameters {plain[:5]} (unsupported module)")
    vocab = int(model.config.vocab_size) // tp
    tp_rank = tp_mesh.get_local_rank()
    state = TensorParallelState(
        tp_group=tp_mesh.get_group(),
        dp_group=mesh["dp"].get_group(),
        tp_rank=tp_rank,
        tp_size=tp,
        vocab_start=tp_rank * vocab,
        vocab_end=(tp_rank + 1) * vocab,
    )
    setattr(model, _STATE_ATTR, state)
    return model


# ----------------------------------------------------------------------------- parallel log-softmax
class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) in the forward, identity in the backward: every rank of the TP group computes the
    same function of the sum, so each rank's gradient for its own summand is the gradient of the sum
    (Megatron's reduce-from-tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _log_normaliser(logits: torch.Tensor, group) -> torch.Tensor:
    """``logsumexp`` over the whole vocabulary of vocabulary-sharded ``logits`` (..., V/tp) -> (...)."""
    shift = logits.detach().amax(dim=-1)
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)  # a constant shift: no gradient through it
    local = torch.exp(logits - shift.unsqueeze(-1)).sum(dim=-1)
    return shift + torch.log(_SumOverRanks.apply(local, group))


def vocab_parallel_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, state: TensorParallelState
) -> torch.Tensor:
    """``log softmax(z)[label]`` from this rank's vocabulary slice ``logits`` (..., V/tp) of the full
    logits z; labels (...) are full-vocabulary ids. Same value and gradient as the unsharded form."""
    group = state.tp_group
    local_labels = labels - state.vocab_start
    mine = (local_labels >= 0) & (local_labels < logits.shape[-1])
    picked = logits.gather(-1, local_labels.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    label_logit = _SumOverRanks.apply(torch.where(mine, picked, torch.zeros_like(picked)), group)
    return label_logit - _log_normaliser(logits, group)


def vocab_parallel_entropy(logits: torch.Tensor, state: TensorParallelState) -> torch.Tensor:
    """Entropy ``logsumexp(z) - sum softmax(z) z`` of the full distribution from this rank's vocabulary
    slice ``logits`` (..., V/tp) -> (...)."""
    group = state.tp_group
    log_z = _log_normaliser(logits, group)
    probs = torch.exp(logits - log_z.unsqueeze(-1))
    return log_z - _SumOverRanks.apply((probs * logits).sum(dim=-1), group)
