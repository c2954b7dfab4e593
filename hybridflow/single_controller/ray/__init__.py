"""Ray backend of the single controller."""

from hybridflow.single_controller.ray.base import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
)
from hybridflow.single_controller.ray.colocate import create_colocated_worker_cls

__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "WorkerDiedError",
    "create_colocated_worker_cls",
]
