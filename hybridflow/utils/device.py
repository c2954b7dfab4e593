"""The one device layer: which device a process computes on, and the calls that depend on it.

``trainer.device`` decides, not the hardware: the worker group starts each worker with
``HYBRIDFLOW_DEVICE=cpu|cuda`` (and, for ``cpu``, ``CUDA_VISIBLE_DEVICES=""`` so a GPU host's GPUs
stay out of reach). Every worker, engine, loss and metric asks this module for its device
(:func:`current_device`), its collective backend (:func:`dist_backend`: gloo on CPU, NCCL on CUDA)
and its memory numbers, as torchtitan's ``device_module`` / verl's ``get_device_id`` do; nothing else
reads ``torch.cuda.is_available()`` to choose a device.

A process that was not started by a worker group (a test, a script) falls back to the backend of an
already initialised process group (gloo: CPU, nccl: CUDA), and otherwise to CUDA when it is visible.
"""

from __future__ import annotations

import os
from typing import Any

import torch

DEVICE_ENV = "HYBRIDFLOW_DEVICE"
DEVICE_TYPES = ("cpu", "cuda")
# CPU feature flags (as /proc/cpuinfo spells them) with native bf16 matmuls. Without them (AVX2, or
# AVX-512 without BF16) bf16 GEMMs run 4-60x slower than fp32, depending on the operand layout.
FAST_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def device_type() -> str:
    """``cpu`` or ``cuda``: what this process computes on (see the module docstring)."""
    configured = os.environ.get(DEVICE_ENV)
    if configured:
        if configured not in DEVICE_TYPES:
            raise ValueError(f"{DEVICE_ENV}={configured!r}; use one of {DEVICE_TYPES}")
        return configured
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def current_device() -> torch.device:
    """The device tensors of this process live on (``cuda:<current>`` or ``cpu``)."""
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dist_backend(kind: str | None = None) -> str:
    """torch.distributed backend for a device type: NCCL on CUDA, gloo on CPU."""
    return "nccl" if (kind or device_type()) == "cuda" else "gloo"


def set_device(local_rank: int) -> None:
    """Select this process's GPU: ``local_rank`` when it sees several, else its only one (Ray gives
    each GPU worker exactly one visible device)."""
    if device_type() == "cuda":
        torch.cuda.set_device(local_rank if torch.cuda.device_count() > 1 else 0)
        # fp32 matmuls (the few left under bf16 mixed precision) on tensor cores
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def worker_env(kind: str) -> dict[str, str]:
    """Environment for a worker process computing on ``kind``; a CPU worker does not see GPUs."""
    if kind not in DEVICE_TYPES:
        raise ValueError(f"device {kind!r}; use one of {DEVICE_TYPES}")
    env = {DEVICE_ENV: kind}
    if kind == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def to_device(value: Any, device: torch.device | str) -> Any:
    """Move a DataProto or tensor (anything with ``.to(device)``) to ``device``; other values as is."""
    from hybridflow.protocol import DataProto

    if isinstance(value, (DataProto, torch.Tensor)):
        return value.to(device)
    return value


def cpuinfo_flags(cpuinfo: str) -> set[str]:
    """The feature flags listed on the ``flags`` lines of ``/proc/cpuinfo`` text (empty if none)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    return flags


def has_fast_bf16(kind: str | None = None) -> bool:
    """Whether bf16 compute is worth choosing over fp32 on ``kind`` (default: this process's device):
    CUDA with native bf16 (Ampere or newer), or a CPU whose ``/proc/cpuinfo`` lists avx512_bf16 or
    amx_bf16. False where the CPU flags cannot be read (not Linux)."""
    kind = kind or device_type()
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return False
    return bool(cpuinfo_flags(text) & FAST_BF16_CPU_FLAGS)


def default_compute_dtype(kind: str) -> torch.dtype:
    """The compute dtype a device gets when the config does not say: bf16 on CUDA (verl's default:
    bf16 params, fp32 master weights and reduction), fp32 on CPU (exact, and never slower on CPUs
    without native bf16)."""
    return torch.bfloat16 if kind == "cuda" else torch.float32


def memory_metrics() -> dict[str, float]:
    """Peak memory of this process: resident set (all devices) and, on CUDA, the allocator's peaks."""
    import resource

    metrics = {"perf/cpu_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device_type() == "cuda":
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    return metrics


def empty_cache() -> None:
    """Return cached, unused device memory to the device (no-op on CPU)."""
    if device_type() == "cuda":
        torch.cuda.empty_cache()


def synchronize() -> None:
    """Wait for queued device work (for timings; no-op on CPU)."""
    if device_type() == "cuda":
        torch.cuda.synchronize()
