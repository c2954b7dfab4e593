"""Load a Hugging Face model from a local directory and make it an FSDP2-sharded training module.

Used by every FSDP worker (actor, reference, critic, reward model) so they share one loading path:
``from_pretrained(local_dir)`` → optional gradient checkpointing → optional LoRA adapter (peft,
trainable causal LMs only) → ``fully_shard`` (not on a mesh of one rank with nothing for FSDP2 to do:
:func:`~hybridflow.workers.fsdp_utils.stays_plain_on_one_rank`) → optimizer over the trainable
parameters.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.models.attention import register_cpu_attention
from hybridflow.models.moe import without_router_aux_loss
from hybridflow.utils.device import current_device, device_type
from hybridflow.workers.fsdp_utils import (
    apply_fsdp2,
    build_lr_scheduler,
    build_optimizer,
    enable_gradient_checkpointing,
    is_tensor_parallel_mesh,
    sharded_units,
    stays_plain_on_one_rank,
    to_dtype,
)
from hybridflow.workers.lora import apply_lora, lora_enabled
from hybridflow.workers.tensor_parallel import apply_tensor_parallel

# Which transformers Auto class builds each kind of model.
AUTO_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "token_value": "AutoModelForTokenClassification",  # critic: one value per token
    "sequence_score": "AutoModelForSequenceClassification",  # reward model: one score per sequence
}
# A vision-language model (its config has ``vision_config``: Qwen2-VL, Qwen2.5-VL) as a policy.
VISION_LM_AUTO_CLASS = "AutoModelForImageTextToText"
# LoRA on a vision-language model: the language model's linears only (peft's exclude_modules regex).
VISION_TOWER_MODULES = r".*\bvisual\b.*"


def is_vision_language(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def auto_class_name(config, kind: str, path: str = "the model") -> str:
    """The transformers Auto class that builds ``kind`` (see :data:`AUTO_CLASSES`) for ``config``."""
    if not is_vision_language(config):
        return AUTO_CLASSES[kind]
    if kind != "causal_lm":
        raise NotImplementedError(
            f"{path} is a vision-language model ({config.model_type}); a {kind} head on it (critic, reward "
            "model) is not built: train it with GRPO (algorithm.adv_estimator=grpo, no critic)"
        )
    return VISION_LM_AUTO_CLASS


def resolve_local_path(path: str) -> str:
    """Expand ``~`` and check that ``path`` is a local model directory (no hub access here)."""
    local = os.path.expanduser(str(path))
    if not os.path.isdir(local):
        raise FileNotFoundError(
            f"model path {path!r} is not a local directory; hybridflow loads models with "
            "from_pretrained(local_dir) only (build one with `python -m hybridflow.models.tiny --out DIR`)"
        )
    return local


def import_external_lib(name: str | None) -> None:
    """verl's ``model.external_lib``: import a module that registers custom architectures."""
    if name:
        importlib.import_module(name)


@dataclass
class TrainingParts:
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None


def load_hf_model(model_cfg, kind: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """A plain (unsharded) model from ``model_cfg.path``. The seed makes freshly initialised heads
    (critic value head, reward head) identical on every rank."""
    import transformers

    path = resolve_local_path(model_cfg.path)
    import_external_lib(model_cfg.get("external_lib"))
    config = transformers.AutoConfig.from_pretrained(
        path, trust_remote_code=model_cfg.get("trust_remote_code", False)
    )
    for key, value in (model_cfg.get("override_config") or {}).items():
        setattr(config, key, value)
    without_router_aux_loss(config)  # an MoE router's auxiliary loss: not in the loss, as in verl
    # value and reward heads without dropout (verl sets the same three for its critic and reward model)
    no_dropout = {"classifier_dropout": 0.0, "hidden_dropout": 0.0, "summary_dropout_prob": 0.0}
    extra = {"num_labels": 1, **no_dropout} if kind != "causal_lm" else {}
    for key, value in extra.items():
        setattr(config, key, value)
    auto_cls = getattr(transformers, auto_class_name(config, kind, path))
    attention = {}
    if device_type() == "cpu" and "attn_implementation" not in (model_cfg.get("override_config") or {}):
        # short-sequence attention without SDPA's slow CPU kernel (hybridflow/models/attention.py)
        attention["attn_implementation"] = register_cpu_attention()
    torch.manual_seed(seed)
    verbosity = transformers.logging.get_verbosity()
    if kind != "causal_lm":  # the new head is expected to be missing from an LM checkpoint: no load report
        transformers.logging.set_verbosity_error()
    try:
        model = auto_cls.from_pretrained(
            path,
            config=config,
            dtype=dtype,
            trust_remote_code=model_cfg.get("trust_remote_code", False),
            **attention,
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
    if kind == "sequence_score" and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = getattr(model.config, "eos_token_id", 0)
    return model


def build_fsdp_module(
    model_cfg, fsdp_cfg, mesh, kind: str = "causal_lm", trainable: bool = True, freeze_vision: bool = False
) -> nn.Module:
    """Load and shard one model; frozen (no grad) unless ``trainable``. A trainable causal LM with
    ``model_cfg.lora_rank > 0`` trains only its LoRA adapter. On a 2-D ``(dp, tp)`` mesh the model is
    first split tensor-parallel over ``tp`` (:mod:`hybridflow.workers.tensor_parallel`), then FSDP2
    shards it over ``dp``. ``freeze_vision``: no gradient for a vision-language model's vision tower."""
    dtype = to_dtype(fsdp_cfg.get("model_dtype", "fp32"))
    model = load_hf_model(model_cfg, kind, dtype)
    if trainable and model_cfg.get("enable_gradient_checkpointing", False):
        enable_gradient_checkpointing(model)
    tensor_parallel = is_tensor_parallel_mesh(mesh)
    if trainable and freeze_vision:  # verl's actor.freeze_vision_tower
        freeze_vision_tower(model)
    if trainable and kind == "causal_lm" and lora_enabled(model_cfg):
        if tensor_parallel:
            raise ValueError("LoRA (model.lora_rank > 0) with tensor parallelism is not supported")
        model = apply_lora(model, _lm_only_lora(model_cfg) if is_vision_language(model.config) else model_cfg)
    if not trainable:
        model.requires_grad_(False)
    if tensor_parallel:
        apply_tensor_parallel(model, mesh)
    if stays_plain_on_one_rank(mesh, fsdp_cfg):
        sharded_units(model, fsdp_cfg)  # a wrap_policy naming no module is still an error
        return model.to(current_device())  # where fully_shard would have put it
    return apply_fsdp2(model, mesh, fsdp_cfg)


def freeze_vision_tower(model: nn.Module) -> None:
    """No gradient for the vision tower (``model.visual``); raises for a model without one."""
    visual = getattr(getattr(model, "model", model), "visual", None)
    if visual is None:
        raise ValueError(
            "actor_rollout_ref.actor.freeze_vision_tower=true but the model has no vision tower "
            f"(model_type={model.config.model_type!r})"
        )
    visual.requires_grad_(False)


def _lm_only_lora(model_cfg):
    """The model section with the vision tower excluded from LoRA (unless exclude_modules is set)."""
    from omegaconf import OmegaConf

    if model_cfg.get("exclude_modules"):
        return model_cfg
    section = OmegaConf.create(OmegaConf.to_container(model_cfg, resolve=True))
    section.exclude_modules = VISION_TOWER_MODULES
    return section


def build_training_parts(
    model_cfg, fsdp_cfg, optim_cfg, mesh, kind: str = "causal_lm", freeze_vision: bool = False
) -> TrainingParts:
    module = build_fsdp_module(model_cfg, fsdp_cfg, mesh, kind, trainable=True, freeze_vision=freeze_vision)
    optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], optim_cfg)
    return TrainingParts(module, optimizer, build_lr_scheduler(optimizer, optim_cfg))
