"""Worker: the base class of every SPMD process in a worker group.

A worker learns who it is from its environment, which the worker group sets when it spawns the
process: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``. The same class therefore runs under Ray, under ``torchrun``, or as a single plain
process (rank 0 of 1).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from hybridflow.single_controller.decorator import Dispatch, Execute, register
from hybridflow.utils.host_memory import keep_freed_host_memory


def configure_torch_threads() -> int:
    """Pin torch's intra-op threads from ``HYBRIDFLOW_NUM_THREADS`` (default: ``OMP_NUM_THREADS`` or 1).

    Worker processes share few cores; each must use a deliberate number of threads or they
    oversubscribe and spin (see PLATFORM_NOTES: a 15x slowdown under contention)."""
    import torch

    threads = int(os.environ.get("HYBRIDFLOW_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1")))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


class Worker:
    """Base class of worker-group members: rank facts, process group setup, dispatch metadata."""

    def __init__(self) -> None:
        configure_torch_threads()
        keep_freed_host_memory()  # step-sized host buffers stay in the process (utils/host_memory.py)
        self._dispatch_info: dict[str, tuple[int, bool]] = {}

    # ------------------------------------------------------------------ identity from the environment
    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", "0"))

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def master_addr(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def master_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "29500"))

    @staticmethod
    def device_type() -> str:
        """``cpu`` or ``cuda``, as ``trainer.device`` set it for this worker (the device layer,
        :func:`hybridflow.utils.device.device_type`)."""
        from hybridflow.utils.device import device_type

        return device_type()

    @property
    def compute_device(self):
        """The torch device this worker computes on; DataProto arguments of registered methods are
        moved there on entry and their DataProto results back to the CPU (see ``@register``)."""
        from hybridflow.utils.device import current_device

        return current_device()

    def init_process_group(self, backend: str | None = None, timeout_s: float = 1800.0) -> str:
        """Join the group's torch.distributed process group (idempotent). NCCL on CUDA (after
        selecting this worker's GPU), gloo on CPU, unless ``backend`` says otherwise; returns the
        backend in use."""
        import torch.distributed as dist

        from hybridflow.utils.device import dist_backend, set_device

        if dist.is_initialized():
            return dist.get_backend()
        backend = backend or dist_backend(self.device_type())
        if self.device_type() == "cuda":
            set_device(self.local_rank)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{self.master_addr}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        return backend

    # ------------------------------------------------------------------ mesh-aware dispatch metadata
    def register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare, for the device mesh ``mesh_name``, this worker's data-parallel rank and whether the
        controller collects its output (e.g. only tp_rank == 0 of each tensor-parallel group)."""
        self._dispatch_info[mesh_name] = (int(dp_rank), bool(is_collect))

    def query_dispatch_info(self, mesh_name: str) -> tuple[int, bool]:
        if mesh_name not in self._dispatch_info:
            raise KeyError(
                f"rank {self.rank} declared no dispatch info for mesh {mesh_name!r} "
                f"(declared: {sorted(self._dispatch_info)}); call register_dispatch_collect_info first"
            )
        return self._dispatch_info[mesh_name]

    # ------------------------------------------------------------------ generic remote helpers
    def process_info(self) -> dict:
        """Facts the controller records per rank (for error messages, colocation checks and the MFU
        peak: the driver itself may have no GPU)."""
        kind = self.device_type()
        name = "cpu"
        if kind == "cuda":
            import torch

            name = torch.cuda.get_device_name()
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "rank": self.rank,
            "device": kind,
            "device_name": name,
        }

    def execute_fn(self, fn, *args, **kwargs):
        """Run an arbitrary picklable function ``fn(worker, *args, **kwargs)`` inside this worker."""
        return fn(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.ALL)
    def barrier(self) -> int:
        """All ranks meet (a no-op without a process group); returns this rank."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        return self.rank
