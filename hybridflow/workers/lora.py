"""LoRA adapters on the actor through ``peft`` (verl's ``actor_rollout_ref.model.lora_rank`` keys).

With ``lora_rank > 0`` the actor is ``get_peft_model(hf_model, LoraConfig(...))`` before sharding:
the base weights are frozen and only the ``lora_A``/``lora_B`` matrices train. Three consumers see
the adapter differently:

- the **reference policy** is the same module with the adapter switched off
  (:func:`adapter_disabled`), so no second copy of the base weights exists;
- the **rollout engine** receives merged weights ``W + scaling * B @ A`` under the plain HF names
  (:func:`merged_hf_weights`), computed per FSDP unit during the weight sync;
- **checkpoints** hold only the trainable (adapter) tensors (``FSDPCheckpointManager(trainable_only=True)``);
  the model merger re-attaches them to the base model for export.

On a mixture-of-experts model ``all-linear`` means the attention and dense parts only
(:func:`hybridflow.models.moe.dense_lora_targets`): routers, gates and experts are not adapted.

Parameter names under peft look like
``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` and
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hybridflow.models.moe import dense_lora_targets, is_moe_config

PEFT_PREFIX = "base_model.model."


def lora_enabled(model_cfg) -> bool:
    return int(model_cfg.get("lora_rank", 0) or 0) > 0


def _target_modules(value):
    """verl accepts ``all-linear``, one module name, or a list of names."""
    if value is None or value == "all-linear":
        return "all-linear"
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def build_lora_config(model_cfg, model: nn.Module | None = None):
    """``peft.LoraConfig`` from the model section (lora_rank, lora_alpha, target_modules,
    exclude_modules). ``all-linear`` on a mixture-of-experts ``model`` is its attention and dense
    linears, by full name (:func:`hybridflow.models.moe.dense_lora_targets`)."""
    try:
        from peft import LoraConfig
    except ImportError as err:  # pragma: no cover - peft is in the models extra
        raise ImportError("LoRA needs peft: pip install -e '.[models]'") from err
    exclude = model_cfg.get("exclude_modules")
    targets = _target_modules(model_cfg.get("target_modules", "all-linear"))
    if targets == "all-linear" and model is not None and is_moe_config(model.config):
        targets = dense_lora_targets(model)
    return LoraConfig(
        r=int(model_cfg.lora_rank),
        lora_alpha=float(model_cfg.get("lora_alpha", 16)),
        target_modules=targets,
        exclude_modules=list(exclude) if isinstance(exclude, list | tuple) else exclude,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, model_cfg) -> nn.Module:
    """Wrap ``model`` with a fresh adapter, or the one saved at ``model_cfg.lora_adapter_path``;
    freezes everything but the adapter."""
    from peft import PeftModel, get_peft_model

    adapter_path = model_cfg.get("lora_adapter_path")
    if adapter_path:
        return PeftModel.from_pretrained(model, str(adapter_path), is_trainable=True)
    return get_peft_model(model, build_lora_config(model_cfg, model))


def is_peft_model(module: nn.Module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def unwrap_peft(module: nn.Module) -> nn.Module:
    """The Hugging Face model under a peft wrapper (the module itself otherwise)."""
    return module.get_base_model() if is_peft_model(module) else module


@contextlib.contextmanager
def adapter_disabled(module: nn.Module) -> Iterator[nn.Module]:
    """Run ``module`` as its base model (the reference policy of a LoRA actor)."""
    if not is_peft_model(module):
        yield module
        return
    with module.disable_adapter():
        yield module


def hf_parameter_name(name: str) -> str | None:
    """A peft parameter name → the base model's HF name; ``None`` for adapter tensors.

    ``base_model.model.model.layers.0.mlp.up_proj.base_layer.weight`` → ``model.layers.0.mlp.up_proj.weight``.
    Names without peft parts come back unchanged.
    """
    parts = name.removeprefix(PEFT_PREFIX).split(".")
    if any(part.startswith("lora_") for part in parts):
        return None
    return ".".join(part for part in parts if part != "base_layer")


def hf_parameter_names(module: nn.Module) -> list[str]:
    """The HF names of ``module``'s base weights (adapter tensors left out)."""
    names = (hf_parameter_name(name) for name, _ in module.named_parameters())
    return [name for name in names if name is not None]


def _lora_delta(module: nn.Module, layer_name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """``scaling * B @ A`` (out, in) of the active adapter of the LoRA layer ``layer_name``, from
    the full tensors in ``tensors``; None when no adapter is active."""
    layer = module.get_submodule(layer_name)
    adapters = getattr(layer, "active_adapters", None) or []
    delta = None
    for adapter in adapters:
        if adapter not in getattr(layer, "lora_A", {}):
            raise NotImplementedError(f"cannot merge the adapter of {layer_name} ({type(layer).__name__})")
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise NotImplementedError("DoRA adapters cannot be merged for the rollout engine")
        a = tensors.get(f"{layer_name}.lora_A.{adapter}.weight")
        b = tensors.get(f"{layer_name}.lora_B.{adapter}.weight")
        if a is None or b is None:
            raise KeyError(f"the adapter of {layer_name} is not in the same FSDP unit as its base weight")
        term = (b.float() @ a.float()) * float(layer.scaling[adapter])
        delta = term if delta is None else delta + term
    return delta


def merged_hf_weights(
    module: nn.Module, bucket: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """One FSDP unit's full parameters ``[(peft name, tensor)]`` → ``[(HF name, tensor)]`` with each
    LoRA layer's adapter merged into its base weight (new tensors; the training weights are not
    touched). A bucket of a plain (non-peft) model comes back as it is."""
    if not is_peft_model(module):
        return bucket
    tensors = dict(bucket)
    merged = []
    for name, tensor in bucket:
        hf_name = hf_parameter_name(name)
        if hf_name is None:
            continue
        if name.endswith(".base_layer.weight"):
            delta = _lora_delta(module, name.removesuffix(".base_layer.weight"), tensors)
            if delta is not None:
                tensor = (tensor.float() + delta).to(tensor.dtype)
        merged.append((hf_name, tensor))
    return merged
