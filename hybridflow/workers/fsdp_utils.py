"""FSDP2 building blocks shared by the actor, critic, reference and reward-model workers.

Sharding follows the PyTorch FSDP2 recipe: ``fully_shard`` each decoder layer, then the root, on a
1-D device mesh over the worker group (gloo on CPU, nccl on CUDA). Parameters stay DTensors sharded
along dim 0; a forward all-gathers one layer at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def to_dtype(name: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


# CPU feature flags (as /proc/cpuinfo spells them) with native bf16 matmuls. Without them (AVX2, or
# AVX-512 without BF16) bf16 GEMMs run 4-60x slower than fp32, depending on the operand layout.
FAST_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpuinfo_flags(cpuinfo: str) -> set[str]:
    """The feature flags listed on the ``flags`` lines of ``/proc/cpuinfo`` text (empty if none)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    return flags


def cpu_has_fast_bf16() -> bool:
    """Whether bf16 compute is worth choosing over fp32 on this machine: CUDA with native bf16
    (Ampere or newer), or a CPU whose ``/proc/cpuinfo`` lists avx512_bf16 or amx_bf16. False where
    the flags cannot be read (not Linux)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported(including_emulation=False)
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return False
    return bool(cpuinfo_flags(text) & FAST_BF16_CPU_FLAGS)


def build_device_mesh(world_size: int, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: modules whose class HF lists in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # unknown architecture: fall back to the children of the largest ModuleList
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        layers = list(max(lists, key=len)) if lists else []
    return layers


def mixed_precision_policy(cfg) -> MixedPrecisionPolicy | None:
    """``fsdp_config.mixed_precision`` ({param_dtype, reduce_dtype, ...}) → FSDP2 policy, or None.
    ``auto`` means bf16 params with fp32 reduction where bf16 is fast (:func:`cpu_has_fast_bf16`),
    else None (fp32)."""
    if cfg == "auto":
        cfg = {"param_dtype": "bf16", "reduce_dtype": "fp32"} if cpu_has_fast_bf16() else None
    if not cfg:
        return None
    return MixedPrecisionPolicy(
        param_dtype=to_dtype(cfg.get("param_dtype"), torch.bfloat16),
        reduce_dtype=to_dtype(cfg.get("reduce_dtype"), torch.float32),
        output_dtype=to_dtype(cfg.get("output_dtype"), torch.float32),
        cast_forward_inputs=True,
    )


def apply_fsdp2(model: nn.Module, mesh: DeviceMesh, fsdp_config) -> nn.Module:
    """Shard ``model`` in place (decoder layers, then root) and return it."""
    kwargs = {"mesh": mesh, "reshard_after_forward": bool(fsdp_config.get("reshard_after_forward", True))}
    root_policy = mixed_precision_policy(fsdp_config.get("mixed_precision")) or MixedPrecisionPolicy()
    # Only the root casts its output (fp32 logits): a layer returning fp32 would hand the root's bf16
    # final norm and head an fp32 activation ("expected m1 and m2 to have the same dtype").
    layer_policy = dataclasses.replace(root_policy, output_dtype=None)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=layer_policy, **kwargs)
    fully_shard(model, mp_policy=root_policy, **kwargs)
    return model


@contextlib.contextmanager
def gathered_for_inference(model: nn.Module) -> Iterator[nn.Module]:
    """Hold the full parameters for a run of forwards (e.g. autoregressive generation): one all-gather
    instead of one per layer per decode step. The parameters are the training ones, unsharded in
    place; they are resharded on exit."""
    if not isinstance(model, FSDPModule):
        yield model
        return
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in fsdp_modules:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for module in fsdp_modules:
            module.reshard()
            module.set_reshard_after_forward(True, recurse=False)


def grad_norm_and_clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip gradients to ``max_norm`` (global over shards); returns the pre-clip total norm (a plain
    scalar tensor). A non-finite norm is returned as is; the caller skips the step."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach().float()


def build_optimizer(params, optim_cfg) -> torch.optim.Optimizer:
    betas = tuple(optim_cfg.get("betas", (0.9, 0.999)))
    return torch.optim.AdamW(
        params, lr=float(optim_cfg.lr), betas=betas, weight_decay=float(optim_cfg.get("weight_decay", 0.01))
    )


def warmup_steps(optim_cfg, total_steps: int) -> int:
    explicit = int(optim_cfg.get("lr_warmup_steps", -1) or -1)
    if explicit >= 0:
        return explicit
    return int(float(optim_cfg.get("lr_warmup_steps_ratio", 0.0)) * total_steps)


def lr_lambda(kind: str, warmup: int, total: int, min_lr_ratio: float, num_cycles: float):
    """Multiplier of the base lr at a step: linear warmup, then constant or cosine down to min_lr_ratio."""

    def constant(step: int) -> float:
        return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0

    def cosine(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        cos = 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * min(progress, 1.0)))
        return min_lr_ratio + (1.0 - min_lr_ratio) * cos

    schedules = {"constant": constant, "cosine": cosine}
    if kind not in schedules:
        raise ValueError(f"unknown lr schedule {kind!r}; use one of {sorted(schedules)}")
    return schedules[kind]


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    total = int(optim_cfg.get("total_training_steps", -1))
    if total <= 0:
        total = 1
    kind = optim_cfg.get("lr_scheduler_type") or optim_cfg.get("warmup_style", "constant")
    fn = lr_lambda(
        kind,
        warmup_steps(optim_cfg, total),
        total,
        float(optim_cfg.get("min_lr_ratio", 0.0) or 0.0),
        float(optim_cfg.get("num_cycles", 0.5)),
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU copy of the weights (collective: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
