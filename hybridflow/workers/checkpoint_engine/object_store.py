"""The fallback checkpoint engine: the whole model through Ray's object store (``object_store``).

Trainer rank 0 copies every tensor of the stream, cast to the rollout's dtype, into host arrays and
returns them from ``send_weights``: that return value stays in Ray's object store and every rollout
rank fetches it (the driver passes the reference on; it never holds a copy). numpy buffers travel
without torch's slow pickling (PLATFORM_NOTES: 0.02-0.12 s per 100 MB against 0.8-2 s for tensors).
Rank 0 holds a full copy of the model for the sync: the collective backends (:mod:`.collective`) do
not. It needs no group and runs wherever Ray does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hybridflow.workers.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry


@CheckpointEngineRegistry.register("object_store")
class ObjectStoreCheckpointEngine(CheckpointEngine):
    """``role``: ``"trainer"`` (rank ``trainer_rank``; rank 0 keeps the arrays) or ``"rollout"``."""

    engine_kwargs_keys = ()
    receives_payload = True  # the receivers are handed rank 0's send_weights result

    def __init__(
        self, bucket_size: int, rollout_dtype: torch.dtype = torch.float32, role: str = "trainer", **kwargs
    ) -> None:
        super().__init__(bucket_size, rollout_dtype)
        self.role, self.trainer_rank = role, 0

    def prepare(self) -> dict[str, Any]:
        return {"role": self.role}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list):
        return {"trainer_rank": list(range(trainer_world_size))}, {"trainer_rank": [-1] * rollout_world_size}

    def init_process_group(self, trainer_rank: int) -> None:
        self.trainer_rank = int(trainer_rank)

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list | None:
        """Rank 0: ``[reference]`` to ``{name: (uint8 array of the tensor's bytes, shape, dtype name)}``
        put in the object store (in a list: whoever gets this result gets the reference, not the
        weights); others: None (they walk the stream for the gathers)."""
        import ray

        found = {}
        for name, tensor in weights:
            if self.trainer_rank == 0:
                cast = tensor.detach().to("cpu", self.rollout_dtype, copy=True).contiguous()
                found[name] = (cast.view(-1).view(torch.uint8).numpy(), tuple(cast.shape), str(cast.dtype))
        self.stats = {"sent_bytes": float(sum(a.nbytes for a, _, _ in found.values()))}
        return [ray.put(found)] if self.trainer_rank == 0 else None

    def receive_weights(self, payload: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``payload``: trainer rank 0's ``send_weights`` result (the weights are fetched from the
        object store)."""
        import ray

        if payload is None:
            raise RuntimeError("object_store: receive_weights needs trainer rank 0's send_weights result")
        for name, (array, shape, dtype) in ray.get(payload[0]).items():
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable.*")  # read-only object-store arrays
                flat = torch.from_numpy(array)
            yield name, flat.view(getattr(torch, dtype.removeprefix("torch."))).view(shape)

    def finalize(self) -> None:
        return None
