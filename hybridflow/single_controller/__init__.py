"""The single controller: workers, worker groups, dispatch modes (Ray backend in ``.ray``)."""

from hybridflow.single_controller.base import ClassWithInitArgs, ResourcePool, WorkerGroup
from hybridflow.single_controller.decorator import (
    Dispatch,
    DispatchMode,
    Execute,
    get_dispatch_mode,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
)
from hybridflow.single_controller.worker import Worker

__all__ = [
    "ClassWithInitArgs",
    "Dispatch",
    "DispatchMode",
    "Execute",
    "ResourcePool",
    "Worker",
    "WorkerGroup",
    "get_dispatch_mode",
    "make_nd_compute_dataproto_dispatch_fn",
    "register",
    "register_dispatch_mode",
]
