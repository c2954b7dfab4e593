"""Mixture-of-experts decoders in training: what hybridflow needs to know about them, in one place.

transformers' Qwen2-MoE (``qwen2_moe``), Qwen3-MoE (``qwen3_moe``) and Mixtral (``mixtral``) train
through the same path as the dense families (docs/model_support.md): FSDP2 shards each decoder layer
(``_no_split_modules`` names the MoE layer classes), the packed rows and dynamic batching are per-token
layouts that a router does not notice (routing is per token, with no capacity limit, so a token's
experts do not depend on which other tokens share its row), and the experts' 3-D weights
``(E, 2 I, H)`` / ``(E, H, I)`` shard along the expert dimension like any other parameter.

Three things differ, each handled here:

- **The router's auxiliary (load-balancing) loss** is not part of the actor's loss, as in verl's FSDP
  actor: ``verl/workers/actor/dp_actor.py`` calls the model without ``labels`` and reads only
  ``output.logits`` (or the fused kernels' log-probs), so HF's ``aux_loss`` never reaches the gradient,
  and verl's Megatron path turns it off (``verl/models/mcore/config_converter.py``:
  ``moe_router_load_balancing_type="none"``, "turn off aux_loss as it hurts perf in RL"). verl has no key
  for it; the HF config's ``output_router_logits`` would only make HF compute a loss that is thrown
  away, and with a 4-D packed-rows mask HF's ``load_balancing_loss_func`` fails on the shapes. The
  trained models are therefore loaded with ``output_router_logits=False``
  (:func:`without_router_aux_loss`).
- **LoRA** adapts the attention and dense parts only (:func:`dense_lora_targets`): the router, the
  shared expert's gate and the experts' 3-D weights keep their base values (peft would otherwise put a
  ``ParamWrapper`` on Mixtral's experts and router under transformers 5).
- **Tensor and expert parallelism** are not built for them: tensor parallelism is refused before Ray
  starts (``hybridflow/trainer/config/parallelism.py``); there is no expert-parallel layout.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

# config fields that count routed experts, by family (Qwen2/3-MoE, Mixtral, DeepSeek)
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_moe_config(config) -> bool:
    """Whether an HF ``config`` (or its ``text_config``), or a ``config.json`` read as a dict, describes
    routed experts."""
    if isinstance(config, dict):
        config = config.get("text_config") or config
        return any(int(config.get(field) or 0) > 0 for field in EXPERT_COUNT_FIELDS)
    config = getattr(config, "text_config", None) or config
    return any(int(getattr(config, field, 0) or 0) > 0 for field in EXPERT_COUNT_FIELDS)


def routed_ids_dtype(num_experts: int):
    """The small int type that holds expert ids ``0 .. num_experts - 1`` in ``routed_experts`` (router
    replay): uint8 up to 256 experts (verl records uint8), else int16."""
    import torch

    return torch.uint8 if num_experts <= 256 else torch.int16


def without_router_aux_loss(config) -> None:
    """Turn off ``output_router_logits`` on an MoE ``config`` in place (see the module docstring: verl's
    FSDP actor never adds the router's auxiliary loss; computing it would waste work and fails on the
    packed rows' 4-D mask). A config that asked for it is logged once."""
    if getattr(config, "output_router_logits", False):
        logger.warning(
            "%s: output_router_logits=true is ignored: the router's auxiliary loss is not part of the "
            "actor's loss, as in verl's FSDP actor (docs/model_support.md)",
            getattr(config, "model_type", "model"),
        )
        config.output_router_logits = False


def mlp_width_per_token(config) -> float:
    """The MLP width a token passes through, averaged over the layers: ``intermediate_size`` for a dense
    decoder; for an MoE one, ``top_k x expert width (+ the shared expert)`` on its sparse layers and
    ``intermediate_size`` on its dense ones (Qwen2-MoE's ``decoder_sparse_step`` / ``mlp_only_layers``).
    A FLOPs estimate: 3 x H x this per token and layer for a SwiGLU MLP."""
    config = getattr(config, "text_config", None) or config
    hidden = int(config.hidden_size)
    dense = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    if not is_moe_config(config):
        return float(dense)
    layers = int(config.num_hidden_layers)
    expert = int(getattr(config, "moe_intermediate_size", None) or dense)
    sparse = int(config.num_experts_per_tok) * expert + int(
        getattr(config, "shared_expert_intermediate_size", 0) or 0
    )
    sparse_layers = sum(is_sparse_layer(config, index) for index in range(layers))
    return (sparse * sparse_layers + dense * (layers - sparse_layers)) / max(1, layers)


def is_sparse_layer(config, index: int) -> bool:
    """Whether decoder layer ``index`` of an MoE ``config`` has routed experts (HF's rule for Qwen2/3-MoE:
    not in ``mlp_only_layers`` and ``(index + 1) % decoder_sparse_step == 0``; Mixtral: every layer)."""
    if index in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (index + 1) % int(getattr(config, "decoder_sparse_step", 1) or 1) == 0


def _expert_modules(model: nn.Module) -> list[str]:
    """Names of the modules holding experts' stacked weights (a parameter of 3 or more dims: (E, ., .))."""
    return [
        name
        for name, module in model.named_modules()
        if any(p.dim() >= 3 for p in module.parameters(recurse=False))
    ]


def dense_lora_targets(model: nn.Module) -> list[str]:
    """The full names of ``model``'s ``nn.Linear`` modules that LoRA adapts on an MoE model: attention
    projections, dense MLPs (Qwen2-MoE's ``mlp_only_layers``) and shared experts. Left out: the output
    embedding (as peft's ``all-linear``), gates (a module named ``gate`` or ``*_gate``: the router, the
    shared expert's sigmoid gate) and anything inside an experts module."""
    from torch import nn

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    experts = _expert_modules(model)
    targets = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, nn.Linear) or module is output:
            continue
        if leaf == "gate" or leaf.endswith("_gate"):
            continue
        if any(name == e or name.startswith(e + ".") for e in experts):
            continue
        targets.append(name)
    return targets
