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
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from hybridflow.utils.device import (  # noqa: F401  (re-exported: tests and older callers import them here)
    FAST_BF16_CPU_FLAGS,
    cpuinfo_flags,
    default_compute_dtype,
    has_fast_bf16,
)

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


def cpu_has_fast_bf16() -> bool:
    """Whether this process's device computes bf16 fast (:func:`hybridflow.utils.device.has_fast_bf16`)."""
    return has_fast_bf16()


def build_device_mesh(world_size: int, device_type: str, tensor_parallel_size: int = 1) -> DeviceMesh:
    """The 1-D ``("fsdp",)`` mesh over the group, or with ``tensor_parallel_size`` t > 1 the 2-D
    ``("dp", "tp")`` mesh of shape (world / t, t): TP groups are t consecutive ranks
    (:mod:`hybridflow.workers.tensor_parallel`)."""
    tp = int(tensor_parallel_size)
    if tp <= 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    if tp > world_size or world_size % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} does not divide the {world_size} worker processes")
    return init_device_mesh(device_type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def is_tensor_parallel_mesh(mesh: DeviceMesh) -> bool:
    return mesh.mesh_dim_names is not None and "tp" in mesh.mesh_dim_names


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The (sub-)mesh FSDP2 shards over: the whole 1-D mesh, or the ``dp`` dimension of a 2-D one."""
    return mesh["dp"] if is_tensor_parallel_mesh(mesh) else mesh


def _decoder_layers(model: nn.Module, class_names=None) -> list[nn.Module]:
    """The repeated blocks to shard one by one: modules whose class is named in ``class_names``
    (``wrap_policy.transformer_layer_cls_to_wrap``, as verl), else in HF's ``_no_split_modules``."""
    if isinstance(class_names, str):
        class_names = [class_names]
    names = set(class_names or getattr(model, "_no_split_modules", None) or [])
    # A vision-language model's vision tower stays in the root unit: HF generate encodes the images
    # outside the root's forward, and an FSDP unit first run outside it fails ("run forward through
    # the root module first"). Unsharded with the root, its blocks run as plain modules.
    vision = {id(m) for name, sub in model.named_modules() if name.endswith("visual") for m in sub.modules()}
    layers = [m for m in model.modules() if type(m).__name__ in names and id(m) not in vision]
    if class_names and not layers:
        raise ValueError(f"wrap_policy.transformer_layer_cls_to_wrap={sorted(names)} matches no module")
    if not layers:  # unknown architecture: fall back to the children of the largest ModuleList
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        layers = list(max(lists, key=len)) if lists else []
    return layers


BF16_MIXED = {"param_dtype": "bf16", "reduce_dtype": "fp32"}


def resolve_mixed_precision(cfg, device_type: str) -> dict | None:
    """``fsdp_config.mixed_precision`` on ``device_type`` as a dict, or None (compute in the
    master-weight dtype). ``null`` is the device's default (as verl: bf16 params with fp32 master
    weights and reduction on CUDA; fp32 on CPU); ``auto`` is bf16 where the device computes it fast
    (:func:`hybridflow.utils.device.has_fast_bf16`); a dict is used as given (``{param_dtype: fp32}``
    keeps a CUDA run in fp32)."""
    if isinstance(cfg, str) and cfg == "auto":
        return dict(BF16_MIXED) if has_fast_bf16(device_type) else None
    if not cfg:
        return dict(BF16_MIXED) if default_compute_dtype(device_type) == torch.bfloat16 else None
    return cfg


def compute_dtype(fsdp_config, device_type: str) -> torch.dtype:
    """The dtype the matmuls run in on ``device_type``: the mixed-precision ``param_dtype`` when one
    applies, else ``model_dtype`` (what the MFU peak is looked up for)."""
    mixed = resolve_mixed_precision(fsdp_config.get("mixed_precision"), device_type)
    if mixed:
        return to_dtype(mixed.get("param_dtype"), torch.bfloat16)
    return to_dtype(fsdp_config.get("model_dtype", "fp32"))


def wants_cpu_offload(fsdp_config) -> bool:
    """verl's ``param_offload`` / ``optimizer_offload`` / ``offload_policy``: any of them selects FSDP2's
    ``CPUOffloadPolicy``, which keeps the sharded parameters, their gradients and so the optimizer
    state on the CPU (the optimizer step runs there) and copies each unit to the device for compute."""
    keys = ("param_offload", "optimizer_offload", "offload_policy")
    return any(bool(fsdp_config.get(k, False)) for k in keys)


def offload_policy(fsdp_config, device_type: str) -> OffloadPolicy:
    """``CPUOffloadPolicy`` when :func:`wants_cpu_offload`, else no offload. Pinned host memory only
    with CUDA: pinning needs an accelerator (on a CPU mesh it fails and would gain nothing)."""
    if not wants_cpu_offload(fsdp_config):
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def mixed_precision_policy(cfg, device_type: str) -> MixedPrecisionPolicy | None:
    """``fsdp_config.mixed_precision`` on ``device_type`` (see :func:`resolve_mixed_precision`) → FSDP2
    policy, or None."""
    cfg = resolve_mixed_precision(cfg, device_type)
    if not cfg:
        return None
    return MixedPrecisionPolicy(
        param_dtype=to_dtype(cfg.get("param_dtype"), torch.bfloat16),
        reduce_dtype=to_dtype(cfg.get("reduce_dtype"), torch.float32),
        output_dtype=to_dtype(cfg.get("output_dtype"), torch.float32),
        cast_forward_inputs=True,
    )


def sharded_units(model: nn.Module, fsdp_config) -> list[nn.Module]:
    """The modules :func:`apply_fsdp2` shards one by one before the root (``fsdp_config.wrap_policy``);
    raises for a ``transformer_layer_cls_to_wrap`` that names no module of ``model``."""
    wrap_policy = fsdp_config.get("wrap_policy") or {}
    return _decoder_layers(model, wrap_policy.get("transformer_layer_cls_to_wrap"))


def set_gradient_sync(module: nn.Module, sync: bool) -> None:
    """Reduce-scatter gradients in this backward (``sync``) or keep accumulating them locally: FSDP2's
    ``set_requires_gradient_sync``, used to sync only a mini-batch's last micro-batch. A plain module
    (one fp32 worker, :func:`stays_plain_on_one_rank`) has nothing to sync: no-op."""
    if hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(sync)


def stays_plain_on_one_rank(mesh: DeviceMesh, fsdp_config) -> bool:
    """Whether the model is left a plain module instead of being FSDP2-sharded: a mesh of one rank
    with nothing for FSDP2 to do (no tensor parallelism, no mixed-precision cast, no CPU offload), and
    ``fsdp_config.shard_one_rank`` false (its default). FSDP2 on one rank only copies: every forward
    all-gathers each unit into a fresh buffer and every backward "reduce-scatters" its gradients into
    another (12-15% of a small model's update on a 2-core AVX-512 CPU, docs/benchmarks.md); the plain
    module computes the same bits without them (tests/workers/test_fsdp_config_keys.py). On CUDA the
    default mixed precision (bf16) keeps FSDP2."""
    if bool(fsdp_config.get("shard_one_rank", False)) or mesh.size() != 1 or is_tensor_parallel_mesh(mesh):
        return False
    if resolve_mixed_precision(fsdp_config.get("mixed_precision"), mesh.device_type):
        return False
    return not wants_cpu_offload(fsdp_config)


def apply_fsdp2(model: nn.Module, mesh: DeviceMesh, fsdp_config) -> nn.Module:
    """Shard ``model`` in place (decoder layers, then root) over ``mesh`` (its ``dp`` dimension when it
    is 2-D: the model is then already tensor-parallel over ``tp``) and return it."""
    kwargs = {
        "mesh": data_parallel_mesh(mesh),
        "reshard_after_forward": bool(fsdp_config.get("reshard_after_forward", True)),
        "offload_policy": offload_policy(fsdp_config, mesh.device_type),
    }
    root_policy = (
        mixed_precision_policy(fsdp_config.get("mixed_precision"), mesh.device_type) or MixedPrecisionPolicy()
    )
    # Only the root casts its output (fp32 logits): a layer returning fp32 would hand the root's bf16
    # final norm and head an fp32 activation ("expected m1 and m2 to have the same dtype").
    layer_policy = dataclasses.replace(root_policy, output_dtype=None)
    for layer in sharded_units(model, fsdp_config):
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
    """AdamW with the fused implementation (one kernel over all parameters on CPU and CUDA: 2.5 ms
    instead of 16-24 ms per step for a 3M model on 2 cores, where the per-parameter loop runs ~8 ops
    per tensor through DTensor dispatch). Same update rule; torch falls back to foreach where a
    parameter's device or dtype has no fused kernel."""
    betas = tuple(optim_cfg.get("betas", (0.9, 0.999)))
    params = list(params)
    kwargs = {
        "lr": float(optim_cfg.lr),
        "betas": betas,
        "weight_decay": float(optim_cfg.get("weight_decay", 0.01)),
    }
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # a device/dtype without a fused kernel
        return torch.optim.AdamW(params, foreach=True, **kwargs)


def explicit_warmup_steps(optim_cfg) -> int:
    """``lr_warmup_steps`` (-1 when unset or null: the ratio decides). 0 means no warmup, as in verl."""
    value = optim_cfg.get("lr_warmup_steps", -1)
    return -1 if value is None else int(value)


def warmup_steps(optim_cfg, total_steps: int) -> int:
    explicit = explicit_warmup_steps(optim_cfg)
    if explicit >= 0:
        return explicit
    return int(float(optim_cfg.get("lr_warmup_steps_ratio", 0.0) or 0.0) * total_steps)


def lr_lambda(kind: str, warmup: int, total: int, min_lr_ratio: float, num_cycles: float):
    """Multiplier of the base lr after ``step`` scheduler steps (0 for the first update), as verl's
    ``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup``: linear warmup from 0
    over ``warmup`` steps, then constant, or a cosine from 1 down to ``min_lr_ratio`` at ``total``."""

    def constant(step: int) -> float:
        return step / max(1, warmup) if step < warmup else 1.0

    def cosine(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        cos = math.cos(math.pi * num_cycles * 2.0 * progress)
        return max(min_lr_ratio, min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + cos))

    schedules = {"constant": constant, "cosine": cosine}
    if kind not in schedules:
        raise ValueError(f"unknown lr schedule {kind!r}; use one of {sorted(schedules)}")
    return schedules[kind]


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """The ``optim`` section's schedule. A cosine decay or a warmup ratio needs
    ``total_training_steps`` (the PPO and SFT trainers fill it in); without it they would silently
    do nothing or end at once, so that is an error."""
    total = int(optim_cfg.get("total_training_steps", -1) or -1)
    kind = optim_cfg.get("lr_scheduler_type") or optim_cfg.get("warmup_style", "constant")
    needs_total = kind == "cosine" or (
        explicit_warmup_steps(optim_cfg) < 0 and float(optim_cfg.get("lr_warmup_steps_ratio", 0.0) or 0.0) > 0
    )
    if total <= 0 and needs_total:
        raise ValueError(
            f"optim.total_training_steps is {total}: a {kind} schedule with lr_warmup_steps_ratio="
            f"{optim_cfg.get('lr_warmup_steps_ratio', 0.0)} needs the run's total number of steps"
        )
    total = max(total, 1)
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
