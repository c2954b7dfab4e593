"""The collective checkpoint engine: buckets broadcast from the trainer's ranks to every rollout rank.

``gloo`` (CPU tensors) and ``nccl`` (CUDA tensors, verl's name) are the same code over two
torch.distributed process-group classes. The groups are built for the sync, apart from the pools' own
process groups: trainer rank ``r`` of ``T`` owns group ``r`` (its rank 0; the ``R`` rollout ranks are
ranks ``1..R`` of every group), rendezvousing through a TCP store trainer rank ``r`` opens in
:meth:`prepare`. They are kept across syncs (``rebuild_group=True`` rebuilds them every sync).

**The stream.** Every trainer rank walks the same ``(name, full tensor)`` stream (the FSDP gathers are
collectives) and cuts it into the same buckets: tensors are packed in order, each cast to the rollout's
dtype as it is copied in, at offsets aligned to :data:`ALIGN` bytes, until ``bucket_size`` bytes are
used. **A tensor larger than what is left is split across buckets** (at element boundaries), so a
bucket never exceeds ``bucket_size``. Bucket ``k`` is packed and broadcast by trainer rank ``k mod T``
only: a header ``[meta bytes, payload bytes, is_last]`` (int64), the metadata (JSON: one
``[name, shape, dtype, first element, elements, byte offset]`` per piece), then the payload. The rollout
ranks receive the buckets in order (bucket ``k`` on group ``k mod T``) and yield each tensor as a view
of the bucket; a split tensor is assembled in a tensor of its own and yielded when its last piece
arrives. Extra memory per rank: one bucket (a receiver also holds a split tensor while it arrives).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

from hybridflow.workers.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

ALIGN = 64  # bytes: every piece starts at a multiple of this (a dtype view needs an aligned offset)
HEADER = 3  # int64 fields: metadata bytes, payload bytes, is_last


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class CollectiveCheckpointEngine(CheckpointEngine):
    """``role``: ``"trainer"`` or ``"rollout"``; ``timeout_s``: how long a broadcast may wait for its
    peers (a dead peer then raises instead of hanging); ``rebuild_group``: new groups every sync."""

    device = "cpu"
    engine_kwargs_keys = ("timeout_s", "rebuild_group")

    def __init__(
        self,
        bucket_size: int,
        rollout_dtype: torch.dtype = torch.float32,
        role: str = "trainer",
        timeout_s: float = 600.0,
        rebuild_group: bool = False,
    ) -> None:
        super().__init__(bucket_size, rollout_dtype)
        if role not in ("trainer", "rollout"):
            raise ValueError(f"checkpoint engine role must be trainer or rollout, got {role!r}")
        if self.bucket_size < ALIGN:
            raise ValueError(f"{type(self).__name__}: bucket_size must be >= {ALIGN} bytes")
        self.role, self.timeout = role, timedelta(seconds=float(timeout_s))
        self.rebuild_group = bool(rebuild_group)
        self.groups: list = []  # trainer: [its own group]; rollout: one per trainer rank, in order
        self.trainer_rank = self.trainer_world_size = 0
        self.buffer: torch.Tensor | None = None
        self._store = None

    # ------------------------------------------------------------------ the group
    def prepare(self) -> dict[str, Any]:
        """Allocate the bucket; a trainer rank opens its group's store (first sync, or every sync with
        ``rebuild_group``). Returns ``{role, ip, port}`` (port: the store's, trainer ranks)."""
        import ray
        import torch.distributed as dist

        self.buffer = torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device)
        if self.role == "trainer" and (self.rebuild_group or not self.groups):
            self._store = dist.TCPStore("0.0.0.0", 0, None, True, self.timeout, wait_for_workers=False)
        port = self._store.port if self._store is not None else None
        return {"role": self.role, "ip": ray.util.get_node_ip_address(), "port": port}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list):
        """Trainer rank r: group r as its rank 0; rollout rank j: rank j+1 of every group, in order.
        On one node every address is 127.0.0.1 (PLATFORM_NOTES: not the node IP)."""
        one_node = len({m["ip"] for m in metadata}) == 1
        masters = [("127.0.0.1" if one_node else m["ip"], m["port"]) for m in metadata[:trainer_world_size]]
        size = rollout_world_size + 1

        def own_host(m):
            return "127.0.0.1" if one_node else m["ip"]

        trainer = {
            "groups": [[(*masters[r], 0)] for r in range(trainer_world_size)],
            "group_size": [size] * trainer_world_size,
            "trainer_rank": list(range(trainer_world_size)),
            "trainer_world_size": [trainer_world_size] * trainer_world_size,
            "host": [own_host(m) for m in metadata[:trainer_world_size]],
        }
        rollout = {
            "groups": [[(*master, j + 1) for master in masters] for j in range(rollout_world_size)],
            "group_size": [size] * rollout_world_size,
            "trainer_rank": [-1] * rollout_world_size,
            "trainer_world_size": [trainer_world_size] * rollout_world_size,
            "host": [own_host(m) for m in metadata[trainer_world_size:]],
        }
        return trainer, rollout

    def init_process_group(
        self, groups: list, group_size: int, trainer_rank: int, trainer_world_size: int, host: str
    ) -> None:
        """Join ``groups`` (``[(store host, store port, rank in group)]``), unless already joined."""
        import torch.distributed as dist

        if self.groups and not self.rebuild_group:
            return
        self.trainer_rank, self.trainer_world_size = int(trainer_rank), int(trainer_world_size)
        self.groups = []
        for store_host, port, rank in groups:
            if rank == 0:
                store = self._store
            else:
                store = dist.TCPStore(store_host, int(port), None, False, self.timeout)
            prefixed = dist.PrefixStore("hybridflow_checkpoint_engine", store)
            self.groups.append(self._new_group(prefixed, int(rank), int(group_size), host))

    def _new_group(self, store, rank: int, size: int, host: str):
        import torch.distributed as dist

        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, size, options)

    def finalize(self) -> None:
        self.buffer = None
        if self.rebuild_group:
            self.groups, self._store = [], None

    def reset(self) -> None:
        self.groups, self._store = [], None

    # ------------------------------------------------------------------ the transfer
    def _broadcast(self, group, tensor: torch.Tensor) -> None:
        if tensor.numel():
            group.broadcast(tensor, 0).wait()

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Walk the whole stream; pack and broadcast the buckets this rank owns (see the module
        docstring). ``stats``: ``buckets_sent``, ``sent_bytes``, ``bucket_peak_bytes``."""
        if self.role != "trainer" or not self.groups:
            raise RuntimeError("send_weights needs a trainer-side engine after init_process_group")
        itemsize = torch.empty((), dtype=self.rollout_dtype).element_size()
        if self.bucket_size < itemsize:
            raise ValueError(f"bucket_size {self.bucket_size} B is smaller than one {self.rollout_dtype}")
        self.stats = {"buckets_sent": 0.0, "sent_bytes": 0.0, "bucket_peak_bytes": 0.0}
        bucket, fill, pieces = 0, 0, []
        for name, tensor in weights:
            flat, done = tensor.reshape(-1), 0
            while True:
                start = _align(fill)
                room = max(self.bucket_size - start, 0) // itemsize
                if room == 0:  # this bucket is full: send it, go on in the next
                    self._flush(bucket, fill, pieces, last=False)
                    bucket, fill, pieces = bucket + 1, 0, []
                    continue
                take = min(room, flat.numel() - done)
                if self._owns(bucket):
                    self.buffer[start : start + take * itemsize].view(self.rollout_dtype).copy_(
                        flat[done : done + take]
                    )
                pieces.append([name, list(tensor.shape), str(self.rollout_dtype), done, take, start])
                fill, done = start + take * itemsize, done + take
                if done >= flat.numel():
                    break
        self._flush(bucket, fill, pieces, last=True)

    def _owns(self, bucket: int) -> bool:
        return bucket % self.trainer_world_size == self.trainer_rank

    def _flush(self, bucket: int, fill: int, pieces: list, last: bool) -> None:
        if not self._owns(bucket):
            return
        group = self.groups[0]
        meta = torch.frombuffer(bytearray(json.dumps(pieces).encode()), dtype=torch.uint8)
        header = torch.tensor([meta.numel(), fill, int(last)], dtype=torch.int64)
        for tensor in (header.to(self.device), meta.to(self.device), self.buffer[:fill]):
            self._broadcast(group, tensor)
        self.stats["buckets_sent"] += 1
        self.stats["sent_bytes"] += fill
        self.stats["bucket_peak_bytes"] = max(self.stats["bucket_peak_bytes"], float(fill))

    def receive_weights(self, payload: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in the rollout's dtype, bucket by bucket until the last (a view of the
        bucket: copy it before the next item)."""
        if self.role != "rollout" or not self.groups:
            raise RuntimeError("receive_weights needs a rollout-side engine after init_process_group")
        pending: dict[str, torch.Tensor] = {}
        bucket, last = 0, False
        while not last:
            group = self.groups[bucket % self.trainer_world_size]
            header = torch.zeros(HEADER, dtype=torch.int64, device=self.device)
            self._broadcast(group, header)
            meta_bytes, fill, last = (int(v) for v in header.tolist())
            meta = torch.empty(meta_bytes, dtype=torch.uint8, device=self.device)
            self._broadcast(group, meta)
            self._broadcast(group, self.buffer[:fill])
            for name, shape, dtype, first, count, start in json.loads(meta.cpu().numpy().tobytes()):
                dtype = _dtype(dtype)
                numel = int(torch.Size(shape).numel())
                piece = self.buffer[start : start + count * dtype.itemsize].view(dtype)
                if first == 0 and count == numel:
                    yield name, piece.view(shape)
                    continue
                if first == 0:
                    pending[name] = torch.empty(numel, dtype=dtype, device=self.device)
                pending[name][first : first + count].copy_(piece)
                if first + count == numel:
                    yield name, pending.pop(name).view(shape)
            bucket += 1
        if pending:
            raise RuntimeError(f"checkpoint engine: incomplete tensors at the last bucket: {sorted(pending)}")


@CheckpointEngineRegistry.register("gloo")
class GlooCheckpointEngine(CollectiveCheckpointEngine):
    """torch.distributed's gloo over CPU buffers: the collective on the CPU."""

    devices = ("cpu",)
    device = "cpu"


@CheckpointEngineRegistry.register("nccl")
class NCCLCheckpointEngine(CollectiveCheckpointEngine):
    """NCCL over CUDA buffers (verl's ``nccl``): the collective on GPUs."""

    devices = ("cuda",)
    device = "cuda"

    def _new_group(self, store, rank: int, size: int, host: str):
        import torch.distributed as dist

        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
