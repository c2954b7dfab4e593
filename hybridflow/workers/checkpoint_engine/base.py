"""verl's checkpoint engine interface: how weights move from the trainer's ranks to the rollout's.

A :class:`CheckpointEngine` lives in every trainer rank and every rollout rank. Per sync the driver
(:class:`~.manager.CheckpointEngineManager`) calls, on all of them:

1. ``prepare()`` → metadata (a rendezvous address, buffers allocated);
2. ``build_topology(trainer_world_size, rollout_world_size, metadata)`` (a classmethod, on the driver)
   → per-rank keyword arguments of ``init_process_group`` for each side;
3. ``init_process_group(**kwargs)``;
4. ``send_weights(weights)`` on the trainer's ranks, with ``weights`` the stream of ``(HF name,
   full tensor)`` every trainer rank walks (:func:`~.weights.trainer_weight_stream`), and
   ``receive_weights()`` on the rollout's, a generator of ``(HF name, tensor)`` that the replica copies
   into its model (:func:`~.weights.load_received`);
5. ``finalize()`` (buffers freed; the group kept for the next sync unless rebuilt).

Backends register by name (:data:`CHECKPOINT_ENGINES`, verl's ``CheckpointEngineRegistry``): ``naive``
(trainer and rollout in one process: the weights are handed over in place), ``gloo`` / ``nccl``
(:mod:`.collective`: a torch.distributed broadcast of buckets) and ``object_store`` (:mod:`.object_store`:
Ray's object store, the fallback). ``actor_rollout_ref.rollout.checkpoint_engine.backend`` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, TypedDict

import torch

from hybridflow.utils.registry import Registry, lookup_in

MIB = 1 << 20


class TensorMeta(TypedDict):
    """One tensor (or a piece of one) in a bucket: ``name``, its full ``shape`` and ``dtype``, and
    ``offset``, where its bytes start in the bucket (verl's fields)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int


class CheckpointEngine(ABC):
    """Moves named tensors from the trainer's ranks to the rollout's (see the module docstring).

    ``bucket_size``: bytes moved per transfer (``update_weights_bucket_megabytes << 20``); the extra
    memory a rank holds during a sync is about one bucket. Subclasses say which devices they run on
    (:attr:`devices`) and whether both sides share a process (:attr:`colocated`)."""

    devices: tuple[str, ...] = ("cpu", "cuda")
    colocated = False

    def __init__(self, bucket_size: int, rollout_dtype: torch.dtype = torch.float32, **kwargs) -> None:
        if int(bucket_size) < 1:
            raise ValueError(f"checkpoint engine bucket_size must be >= 1 byte, got {bucket_size}")
        self.bucket_size = int(bucket_size)
        self.rollout_dtype = rollout_dtype
        self.stats: dict[str, float] = {}

    @abstractmethod
    def prepare(self) -> dict[str, Any] | None:
        """Before each sync: allocate what the transfer needs; return this rank's rendezvous metadata."""

    @classmethod
    @abstractmethod
    def build_topology(
        cls, trainer_world_size: int, rollout_world_size: int, metadata: list
    ) -> tuple[dict[str, list], dict[str, list]]:
        """``metadata``: every rank's ``prepare()`` (trainer ranks first). Returns the keyword arguments
        of ``init_process_group`` as ``{key: one value per rank}`` for the trainer, then the rollout."""

    @abstractmethod
    def init_process_group(self, **kwargs) -> None:
        """Join the sync's communication group (kept across syncs unless the backend rebuilds it)."""

    @abstractmethod
    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        """Trainer side: consume the whole stream ``weights`` (every trainer rank must: gathering a
        tensor is a collective) and send this rank's share of it."""

    @abstractmethod
    def receive_weights(self, payload: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Rollout side: ``(name, tensor)`` in the rollout's dtype. A tensor may be a view of a buffer
        that the next item overwrites: copy it before asking for the next."""

    @abstractmethod
    def finalize(self) -> None:
        """After each sync: free the buffers (and the group, where the backend rebuilds it)."""

    def reset(self) -> None:
        """Forget the group kept across syncs: the next sync builds a new one (the rollout's ranks
        changed: a replica died and a new process took its place)."""
        return None  # nothing kept by default


CHECKPOINT_ENGINES: Registry = Registry("checkpoint engine backend")


class CheckpointEngineRegistry:
    """verl's registry API over :data:`CHECKPOINT_ENGINES`."""

    @staticmethod
    def register(backend: str):
        return CHECKPOINT_ENGINES.register(backend)

    @classmethod
    def get(cls, backend: str) -> type[CheckpointEngine]:
        return lookup_in(CHECKPOINT_ENGINES, backend, f"Unknown checkpoint engine backend {backend!r}")

    @classmethod
    def new(cls, backend: str, *args, **kwargs) -> CheckpointEngine:
        return cls.get(backend)(*args, **kwargs)


@CheckpointEngineRegistry.register("naive")
class ColocatedCheckpointEngine(CheckpointEngine):
    """Trainer and rollout in one process (the hybrid engine of ``main_ppo``): ``send_weights`` keeps
    the stream and ``receive_weights`` yields from it, so each tensor goes straight from the gathered
    FSDP unit into the engine (verl's ``naive``). There is no group to build."""

    colocated = True

    def __init__(self, bucket_size: int, rollout_dtype: torch.dtype = torch.float32, **kwargs) -> None:
        super().__init__(bucket_size, rollout_dtype)
        self.weights: Iterable[tuple[str, torch.Tensor]] | None = None

    def prepare(self) -> None:
        return None

    @classmethod
    def build_topology(cls, trainer_world_size, rollout_world_size, metadata):
        raise NotImplementedError("naive: trainer and rollout share a process; there is no topology")

    def init_process_group(self, **kwargs) -> None:
        raise NotImplementedError("naive: trainer and rollout share a process; there is no group")

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.weights = weights

    def receive_weights(self, payload: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.weights or ():
            yield name, tensor.to(self.rollout_dtype)
        self.weights = None

    def finalize(self) -> None:
        self.weights = None


def backend_problem(backend: str, device: str, colocated: bool) -> str | None:
    """Why ``backend`` cannot move weights on ``device`` with the pools colocated (``main_ppo``'s hybrid
    engine) or apart (``fully_async_main``); None when it can. One home for the check both entry
    points make before Ray starts."""
    key = "actor_rollout_ref.rollout.checkpoint_engine.backend"
    if backend not in CHECKPOINT_ENGINES:
        return f"{key}={backend!r} is unknown; registered: {', '.join(CHECKPOINT_ENGINES.names())}"
    cls = CHECKPOINT_ENGINES.get(backend)
    engines = {name: CHECKPOINT_ENGINES.get(name) for name in CHECKPOINT_ENGINES.names()}
    fits = [name for name, c in engines.items() if device in c.devices and c.colocated == colocated]
    where = "share a process (main_ppo)" if colocated else "are separate pools (fully_async_main)"
    if device not in cls.devices:
        return f"{key}={backend} does not run on {device}; use one of {', '.join(fits)}"
    if cls.colocated != colocated:
        return f"{key}={backend}: here trainer and rollout {where}; use one of {', '.join(fits)}"
    return None


def default_backend(device: str) -> str:
    """The collective for ``device`` when the pools are apart: ``nccl`` on CUDA, ``gloo`` on the CPU."""
    return "nccl" if device == "cuda" else "gloo"
