"""The one device layer: which device a process computes on, and the calls that depend on it.

``trainer.device`` decides, not the hardware: the worker group starts each worker with
``HYBRIDFLOW_DEVICE=cpu|cuda`` (and, for ``cpu``, ``CUDA_VISIBLE_DEVICES=""`` so a GPU host's GPUs
stay out of reach). Every worker, engine, loss and metric asks this module for its device
(:func:`current_device`), its collective backend (:func:`dist_backend`: gloo on CPU, NCCL on CUDA)
and its memory numbers, as torchtitan's ``device_module`` / verl's ``get_device_id`` do; nothing else
reads ``torch.cuda.is_available()`` to choose a device.

A process that was not started by a worker group (a test, a script) falls back to the backend of an
already initialised process group (gloo: CPU, nccl: CUDA), and otherwise to CUDA when it is visible.

verl's names are at the end (``get_device_name``, ``get_torch_device``, ``get_nccl_backend``,
``get_device_id``): on the CPU ``get_torch_device()`` answers ``torch.cuda``'s calls, and the
backend is gloo, so device-agnostic verl code runs unchanged.
"""

from __future__ import annotations

import contextlib
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


_process_peak_kib = 0  # the largest VmHWM read before a phase reset it (see phase_peak_rss)


def _vm_hwm_kib() -> int | None:
    """This process's peak resident set since start or the last reset (Linux ``VmHWM``), KiB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


@contextlib.contextmanager
def phase_peak_rss():
    """Measure the peak resident set of one phase of this process (a dict ``{"gb": ...}`` filled on exit).

    Linux keeps one high-water mark per process (``VmHWM``, which ``getrusage``'s ``ru_maxrss`` also
    reads); writing ``5`` to ``/proc/self/clear_refs`` resets it to the current resident set. The
    mark reached before the reset is kept for :func:`memory_metrics`' whole-process peak. Where the
    reset is not allowed the phase's figure is the whole-process peak (never less than the truth)."""
    global _process_peak_kib
    result: dict[str, float] = {}
    before = _vm_hwm_kib()
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass
    if before is not None:
        _process_peak_kib = max(_process_peak_kib, before)
    try:
        yield result
    finally:
        after = _vm_hwm_kib()
        if after is not None:
            _process_peak_kib = max(_process_peak_kib, after)
            result["gb"] = after / 2**20


def memory_metrics() -> dict[str, float]:
    """Peak memory of this process: resident set (all devices) and, on CUDA, the allocator's peaks."""
    import resource

    peak_kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _process_peak_kib)
    metrics = {"perf/cpu_peak_rss_gb": peak_kib / 2**20}
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


# ---------------------------------------------------------------------------------------------------
# verl's device helpers, so device-agnostic code written for verl runs here, on the CPU too.

is_cuda_available = torch.cuda.is_available()
is_npu_available = False  # hybridflow runs on CUDA or the CPU


def get_device_name() -> str:
    """``cuda`` or ``cpu``: :func:`device_type` under verl's name."""
    return device_type()


def get_nccl_backend() -> str:
    """The collective backend for this process's device: NCCL on CUDA, gloo on the CPU (verl answers
    ``nccl`` everywhere but NPUs, which fails on a CPU-only host)."""
    return dist_backend()


def get_visible_devices_keyword() -> str:
    return "CUDA_VISIBLE_DEVICES"


def get_resource_name() -> str:
    return "GPU"


class CpuDeviceModule:
    """``torch.cuda``'s interface answered for the CPU, for code that calls
    ``get_torch_device().set_device(rank)``, ``.current_device()``, ``.empty_cache()``, ...

    Device selection and cache calls are no-ops; the current device is index 0 of one; the device
    memory counters read 0 (the CPU has no device allocator); seeds and RNG state are torch's global
    ones. Names it does not define come from ``torch.cpu`` (``Stream``, ``Event``, ``stream``, ...).
    """

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device=None) -> None:
        """No-op: a CPU process has one device."""

    @staticmethod
    def synchronize(device=None) -> None:
        """No-op: CPU work is synchronous."""

    @staticmethod
    def empty_cache() -> None:
        """No-op: no device cache to return."""

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        """No-op (see :meth:`memory_allocated`)."""

    reset_max_memory_allocated = reset_peak_memory_stats

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        """``(free, total)`` bytes of host memory, as ``torch.cuda.mem_get_info`` answers for a GPU."""
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return including_emulation or has_fast_bf16("cpu")


_CPU_DEVICE_MODULE = CpuDeviceModule()


def get_torch_device():
    """``torch.cuda`` on CUDA; on the CPU a :class:`CpuDeviceModule` answering the same calls."""
    return torch.cuda if device_type() == "cuda" else _CPU_DEVICE_MODULE


def get_device_id() -> int:
    """Index of this process's current device (0 on the CPU)."""
    return get_torch_device().current_device()
