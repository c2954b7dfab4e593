"""Resharding the actor from its training layout to its generation layout (HybridFlow §5, 3D-HybridEngine).

Training: ``world`` ranks on a ``(dp, t)`` mesh; rank ``r = d * t + i`` holds TP shard ``i`` of each split
matrix (:mod:`hybridflow.workers.tensor_parallel`), of which FSDP2 keeps the dim-0 chunk ``d``.
Generation: groups of ``t_g`` ranks, each rank holding ``1 / t_g`` of every split matrix
(:mod:`.parallel`). :class:`ReshardLayout` forms the generation groups as the paper does:

- ``t_g <= t``: each training TP group (``t`` consecutive ranks) is cut into ``t_g`` *micro-DP groups*
  of ``m = t / t_g`` consecutive ranks. Rank ``i`` of the TP group is generation rank ``g = i // m`` of
  the generation group made of the ranks with the same ``i % m`` (strided by ``m``). Generation shard
  ``g`` is the union of the training shards of micro-DP group ``g``, so a rank builds it from what it and
  its micro-DP peers hold; the rank's own training shard is already part of it.
- ``t_g > t`` (FSDP-only training is ``t = 1``): the same rule on FSDP's dim-0 chunks
  (:meth:`ReshardLayout.gen_coords`): each rank's own chunk lies inside its generation shard.

:func:`reshard_weights` moves, one FSDP unit at a time, exactly the pieces each rank lacks: every rank
computes every rank's source block (what it holds) and target block (what its engine needs) from the
layout alone, and one ``all_to_all`` per unit (split into buckets of at most :data:`BUCKET_BYTES`)
sends each rank the intersections it needs. With FSDP2 the
source block of a rank is its dp chunk of its TP shard, so the pieces come from the micro-DP peers *and*
their dp replicas: what FSDP's own forward all-gather would fetch, and nothing more. No rank
materialises a whole parameter unless ``t_g = 1``; the transient memory is one bucket's send and
receive buffers. The engine's weights are the only copy in the generation layout and are freed between
rollouts (``free_cache_engine``). Every sync is checked by the :class:`WeightLedger`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.workers.rollout.engine.weight_sync import SyncStats, WeightLedger, iter_unit_parameters
from hybridflow.workers.tensor_parallel import split_dim

Box = tuple[tuple[int, int], ...]  # (start, end) per dim of the full tensor
# An exchange moves the parameters of one FSDP unit, split where their generation shards exceed this
# many bytes: it bounds the send + receive buffers (an embedding alone can be a large share of M).
BUCKET_BYTES = 32 * 2**20


@dataclass(frozen=True)
class ReshardLayout:
    """Training ``(dp, train_tp)`` over ``world`` ranks and generation groups of ``gen_tp`` ranks."""

    world: int
    train_tp: int = 1
    gen_tp: int = 1

    def __post_init__(self) -> None:
        t, tg, w = self.train_tp, self.gen_tp, self.world
        if t < 1 or tg < 1 or w % t or w % tg or (t % tg and tg % t):
            raise ValueError(
                f"layouts do not nest: {w} ranks, training tensor_model_parallel_size={t}, "
                f"rollout tensor_model_parallel_size={tg} (each must divide the ranks, one the other)"
            )

    @property
    def train_dp(self) -> int:
        return self.world // self.train_tp

    @property
    def gen_dp(self) -> int:
        return self.world // self.gen_tp

    @property
    def trivial(self) -> bool:
        """No tensor parallelism on either side: the plain FSDP-unit all-gather sync applies."""
        return self.train_tp == 1 and self.gen_tp == 1

    def train_coords(self, rank: int) -> tuple[int, int]:
        """``(dp rank, tp rank)`` in training."""
        return divmod(rank, self.train_tp)

    def gen_coords(self, rank: int) -> tuple[int, int]:
        """``(generation dp rank, generation tp rank)``: which group, and which shard within it.

        Rank ``(d, i)`` holds block ``u = i * dp + d`` of the ``world`` equal dim-0 blocks of a
        column-split matrix (TP shard i, FSDP chunk d); generation shard ``g`` is the ``world / t_g``
        consecutive blocks from ``g * world / t_g`` on. Choosing ``g = u // (world / t_g)`` puts each
        rank's own block inside its generation shard, and the group ``u % (world / t_g)`` gathers it
        from its peers. For ``t_g <= t`` the peers are the micro-DP group (the ranks of the same TP
        group and dp rank with the same ``i // (t / t_g)``), as in the paper."""
        d, i = self.train_coords(rank)
        blocks = i * self.train_dp + d
        return blocks % self.gen_dp, blocks // self.gen_dp

    def gen_groups(self) -> list[list[int]]:
        """Every generation group, its ranks ordered by generation tp rank."""
        groups = [[0] * self.gen_tp for _ in range(self.gen_dp)]
        for rank in range(self.world):
            group, g = self.gen_coords(rank)
            groups[group][g] = rank
        return groups

    # -------------------------------------------------------------- blocks of one parameter
    def source_box(self, name: str, shape: tuple[int, ...], rank: int) -> Box:
        """The block of parameter ``name`` (full ``shape``) that ``rank`` holds in training."""
        d, i = self.train_coords(rank)
        box = [(0, size) for size in shape]
        dim = split_dim(name) if self.train_tp > 1 else None
        if dim is not None:
            part = shape[dim] // self.train_tp
            box[dim] = (i * part, (i + 1) * part)
        rows = box[0][1] - box[0][0]
        chunk = math.ceil(rows / self.train_dp)  # FSDP2: torch.chunk of dim 0 over the dp ranks
        start = box[0][0]
        box[0] = (start + min(d * chunk, rows), start + min((d + 1) * chunk, rows))
        return tuple(box)

    def replica(self, name: str, rank: int) -> int:
        """Which copy of its block ``rank`` holds: the TP ranks of one dp rank hold the same chunk of a
        replicated parameter; a receiver takes it from the copy in its own TP position only."""
        replicated = self.train_tp > 1 and split_dim(name) is None
        return self.train_coords(rank)[1] if replicated else 0

    def target_box(self, name: str, shape: tuple[int, ...], rank: int) -> Box:
        """The block of parameter ``name`` that ``rank``'s engine holds."""
        box = [(0, size) for size in shape]
        dim = split_dim(name) if self.gen_tp > 1 else None
        if dim is not None:
            g = self.gen_coords(rank)[1]
            part = shape[dim] // self.gen_tp
            box[dim] = (g * part, (g + 1) * part)
        return tuple(box)

    def piece(self, name: str, shape: tuple[int, ...], sender: int, receiver: int) -> Box | None:
        """The block ``sender`` gives ``receiver`` (None: nothing)."""
        if self.replica(name, sender) != self.replica(name, receiver):
            return None
        return _intersect(self.source_box(name, shape, sender), self.target_box(name, shape, receiver))


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(lo_a, lo_b), min(hi_a, hi_b)) for (lo_a, hi_a), (lo_b, hi_b) in zip(a, b, strict=True))
    return box if all(lo < hi for lo, hi in box) else None


def _view(tensor: torch.Tensor, box: Box, origin: Box) -> torch.Tensor:
    """The part of ``tensor`` (which holds block ``origin`` of the full tensor) that is block ``box``."""
    for dim, ((lo, hi), (base, _)) in enumerate(zip(box, origin, strict=True)):
        tensor = tensor.narrow(dim, lo - base, hi - lo)
    return tensor


def _numel(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


@dataclass
class _Transfer:
    """One parameter of a unit: this rank's local block and where the pieces for its engine go."""

    name: str
    shape: tuple[int, ...]
    local: torch.Tensor
    target: torch.Tensor | None  # the engine region (None: the ledger refused the name)


def _buckets(transfers: list[_Transfer], layout: ReshardLayout, rank: int) -> list[list[_Transfer]]:
    """Consecutive runs of ``transfers`` whose generation shards hold at most :data:`BUCKET_BYTES` (a
    larger parameter is a run of its own). Every rank cuts at the same places: shard sizes are equal."""
    runs: list[list[_Transfer]] = [[]]
    size = 0
    for item in transfers:
        nbytes = _numel(layout.target_box(item.name, item.shape, rank)) * item.local.element_size()
        if runs[-1] and size + nbytes > BUCKET_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += nbytes
    return [run for run in runs if run]


def _exchange_unit(transfers: list[_Transfer], layout: ReshardLayout, rank: int) -> tuple[int, int, int]:
    """One all_to_all moving every piece of a unit; returns (bytes sent, bytes received, buffer bytes)."""
    sends, send_sizes, recv_sizes, placements = [], [], [], []
    for peer in range(layout.world):
        sent = received = 0
        for item in transfers:
            own = layout.source_box(item.name, item.shape, rank)
            mine = layout.target_box(item.name, item.shape, rank)
            out_box = layout.piece(item.name, item.shape, rank, peer)
            in_box = layout.piece(item.name, item.shape, peer, rank)
            if peer == rank:  # already here: a local copy, nothing on the wire
                if in_box is not None and item.target is not None:
                    _view(item.target, in_box, mine).copy_(_view(item.local, in_box, own))
                continue
            if out_box is not None:
                sends.append(_view(item.local, out_box, own).reshape(-1))
                sent += _numel(out_box)
            if in_box is not None:
                placements.append((item, in_box, mine))
                received += _numel(in_box)
        send_sizes.append(sent)
        recv_sizes.append(received)
    dtype = transfers[0].local.dtype
    device = transfers[0].local.device
    send = torch.cat(sends) if sends else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes)
    offset = 0
    for item, box, mine in placements:
        n = _numel(box)
        if item.target is not None:
            region = _view(item.target, box, mine)
            region.copy_(recv[offset : offset + n].view(region.shape))
        offset += n
    element = send.element_size()
    return send.numel() * element, recv.numel() * element, (send.numel() + recv.numel()) * element


def reshard_weights(engine_model, module: nn.Module, layout: ReshardLayout, rank: int) -> SyncStats:
    """Fill ``engine_model`` (this rank's generation shard) from the training ``module`` (its FSDP2 /
    TP-sharded parameters, read in place: no unit is unsharded). A collective over the whole group.
    Raises :class:`WeightSyncError` unless every engine weight arrived once, whole and well shaped."""
    start = time.perf_counter()
    ledger = WeightLedger(engine_model)
    sent = received = peak = count = 0
    covered: dict[str, int] = {}
    with torch.no_grad():
        for bucket in iter_unit_parameters(module):
            transfers = []
            for name, param in bucket:
                shape = tuple(param.shape)
                local = param.to_local() if hasattr(param, "to_local") else param
                # CPU-offloaded shards (param_offload) go to the engine's device: NCCL moves device tensors
                local = local.detach().to(engine_model.device)
                expected = _numel(layout.source_box(name, shape, rank))
                if local.numel() != expected:
                    raise RuntimeError(
                        f"{name}: rank {rank} holds {tuple(local.shape)}, the layout {expected} elements"
                    )
                box = layout.target_box(name, shape, rank)
                gen_shape = tuple(hi - lo for lo, hi in box)
                known = ledger.accept_shape(name, gen_shape)
                target = engine_model.target(name) if known else None
                transfers.append(_Transfer(name, shape, local, target))
                if known:
                    covered[name] = _numel(box)
                    count += 1
            for chunk in _buckets(transfers, layout, rank):
                out_bytes, in_bytes, buffers = _exchange_unit(chunk, layout, rank)
                sent, received, peak = sent + out_bytes, received + in_bytes, max(peak, buffers)
    ledger.check()
    copied = sum(covered.values()) * engine_model.dtype.itemsize if covered else 0
    return SyncStats(time.perf_counter() - start, count, copied, peak, sent, received)
