"""verl's checkpoint engine (``verl/checkpoint_engine``): weights from the trainer's ranks to the
rollout's, by a registered backend. :mod:`.base` has the interface and the registry, :mod:`.collective`
the ``gloo`` / ``nccl`` broadcast of buckets, :mod:`.object_store` the fallback through Ray's object
store, :mod:`.manager` the driver's side and the worker methods, :mod:`.weights` both ends' tensors.
The backends need only torch to import (the config checks read the registry); :mod:`.manager`, which
brings the worker machinery, loads on first use of its names.
"""

from hybridflow.workers.checkpoint_engine.base import (
    CHECKPOINT_ENGINES,
    CheckpointEngine,
    CheckpointEngineRegistry,
    ColocatedCheckpointEngine,
    TensorMeta,
    backend_problem,
    default_backend,
)
from hybridflow.workers.checkpoint_engine.collective import (
    CollectiveCheckpointEngine,
    GlooCheckpointEngine,
    NCCLCheckpointEngine,
)
from hybridflow.workers.checkpoint_engine.object_store import ObjectStoreCheckpointEngine
from hybridflow.workers.checkpoint_engine.weights import load_received, trainer_weight_stream

__all__ = [
    "CHECKPOINT_ENGINES",
    "CheckpointEngine",
    "CheckpointEngineManager",
    "CheckpointEngineRegistry",
    "CheckpointEngineWorker",
    "ColocatedCheckpointEngine",
    "CollectiveCheckpointEngine",
    "GlooCheckpointEngine",
    "NCCLCheckpointEngine",
    "ObjectStoreCheckpointEngine",
    "TensorMeta",
    "backend_problem",
    "default_backend",
    "load_received",
    "measured_sync",
    "new_checkpoint_engine",
    "trainer_weight_stream",
]

_MANAGER_NAMES = (
    "CheckpointEngineManager",
    "CheckpointEngineWorker",
    "measured_sync",
    "new_checkpoint_engine",
)


def __getattr__(name: str):
    if name in _MANAGER_NAMES:
        from hybridflow.workers.checkpoint_engine import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
