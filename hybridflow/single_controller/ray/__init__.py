"""Ray backend of the single controller."""

from hybridflow.single_controller.ray.base import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    wait_futures,
)
from hybridflow.single_controller.ray.colocate import create_colocated_worker_cls

__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "WorkerDiedError",
    "wait_futures",
    "create_colocated_worker_cls",
]
