"""Balancing sequence lengths across data-parallel ranks and token-budget micro-batches.

The cost of a forward/backward pass grows with the number of real tokens, so sequences are assigned to
``k`` partitions with nearly equal token sums. The partitioner is the Karmarkar–Karp largest differencing
method (LDM, https://en.wikipedia.org/wiki/Largest_differencing_method), generalised to ``k`` sets as in
verl: every item starts as a k-tuple of sets; the two tuples with the largest spread (max sum − min sum)
are merged by pairing the largest set of one with the smallest set of the other, until one tuple is left.
For ``equal_size`` the initial tuples are the sorted items taken ``k`` at a time, one per set, so every
merge keeps the set sizes equal.

LDM is not optimal; its largest sum is within ``4/3 - 1/(3k)`` of the optimum (Michiels et al., 2007).
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from tensordict import TensorDict

    from hybridflow.protocol import DataProto

__all__ = [
    "calculate_workload",
    "ceildiv",
    "get_group_balanced_partitions",
    "get_reverse_idx",
    "get_seqlen_balanced_partitions",
    "karmarkar_karp",
    "log_seqlen_unbalance",
    "prepare_dynamic_batch",
    "rearrange_micro_batches",
    "rearrange_micro_batches_indices",
    "restore_dynamic_batch",
    "roundup_divisible",
]


class _KSets:
    """``k`` sets of item indices with their sums, kept in decreasing order of sum."""

    def __init__(self, items: list[tuple[int, int]], k: int) -> None:
        self.sums = [0] * k
        self.items: list[list[int]] = [[] for _ in range(k)]
        for slot, (idx, seqlen) in enumerate(items):
            self.sums[slot] = seqlen
            self.items[slot].append(idx)
        self._sort()

    def _sort(self) -> None:
        order = sorted(range(len(self.sums)), key=lambda i: self.sums[i], reverse=True)
        self.sums = [self.sums[i] for i in order]
        self.items = [self.items[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: _KSets) -> None:
        """Pair our i-th largest set with ``other``'s i-th smallest: the difference shrinks."""
        k = len(self.sums)
        for i in range(k):
            self.sums[i] += other.sums[k - 1 - i]
            self.items[i].extend(other.items[k - 1 - i])
        self._sort()


def karmarkar_karp(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split item indices into ``k_partitions`` lists with balanced ``seqlen`` sums (LDM).

    With ``equal_size`` every partition holds ``len(seqlen_list) / k_partitions`` items (the length must
    divide). Partitions come out in decreasing order of sum; indices inside one are in merge order.
    """
    if k_partitions < 1:
        raise ValueError(f"karmarkar_karp: k_partitions must be >= 1, got {k_partitions}")
    if equal_size and len(seqlen_list) % k_partitions != 0:
        n = len(seqlen_list)
        raise ValueError(f"karmarkar_karp: {n} items do not split into {k_partitions} equal parts")
    ordered = sorted((seqlen, idx) for idx, seqlen in enumerate(seqlen_list))
    if equal_size:
        groups = [ordered[i : i + k_partitions] for i in range(0, len(ordered), k_partitions)]
    else:
        groups = [[item] for item in ordered]
    if not groups:
        return [[] for _ in range(k_partitions)]
    # Max-heap: largest spread first, then largest top set (as verl); the counter makes ties deterministic.
    counter = itertools.count()

    def entry(state: _KSets) -> tuple[int, int, int, _KSets]:
        return (-state.spread, -state.sums[0], next(counter), state)

    heap = [entry(_KSets([(idx, s) for s, idx in group], k_partitions)) for group in groups]
    heapq.heapify(heap)
    while len(heap) > 1:
        first = heapq.heappop(heap)[-1]
        second = heapq.heappop(heap)[-1]
        first.merge(second)
        heapq.heappush(heap, entry(first))
    return [list(items) for items in heap[0][-1].items]


def get_seqlen_balanced_partitions(
    seqlen_list: list[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """``karmarkar_karp`` validated: ``k_partitions`` non-empty lists, each index exactly once, sorted."""
    if len(seqlen_list) < k_partitions:
        raise ValueError(f"{len(seqlen_list)} items cannot fill {k_partitions} non-empty partitions")
    partitions = karmarkar_karp(seqlen_list, k_partitions, equal_size)
    if len(partitions) != k_partitions or any(not p for p in partitions):
        raise AssertionError(f"karmarkar_karp returned empty or missing partitions: {partitions}")
    flat = sorted(idx for p in partitions for idx in p)
    if flat != list(range(len(seqlen_list))):
        raise AssertionError("karmarkar_karp did not place every index exactly once")
    return [sorted(p) for p in partitions]


def log_seqlen_unbalance(
    seqlen_list: list[int], partitions: list[list[int]], prefix: str = "global_seqlen"
) -> dict[str, float]:
    """Token sums per rank before balancing (contiguous equal chunks) and after (``partitions``).

    Keys as in verl: ``{prefix}/min``, ``/max``, ``/minmax_diff`` (contiguous split), ``/balanced_min``,
    ``/balanced_max`` (the given partitions) and ``/mean`` (total / number of partitions).
    """
    k = len(partitions)
    chunk = max(1, len(seqlen_list) // k)
    chunk_sums = [sum(seqlen_list[i : i + chunk]) for i in range(0, len(seqlen_list), chunk)]
    balanced_sums = [sum(seqlen_list[i] for i in p) for p in partitions]
    return {
        f"{prefix}/min": min(chunk_sums),
        f"{prefix}/max": max(chunk_sums),
        f"{prefix}/minmax_diff": max(chunk_sums) - min(chunk_sums),
        f"{prefix}/balanced_min": min(balanced_sums),
        f"{prefix}/balanced_max": max(balanced_sums),
        f"{prefix}/mean": sum(seqlen_list) / k,
    }


def rearrange_micro_batches_indices(
    seqlens: list[int], max_token_len: int, min_num_micro_batch: int | None = None
) -> list[list[int]]:
    """Group rows into micro-batches of at most ``max_token_len`` tokens, balanced with LDM.

    Starts from ``ceil(sum / max_token_len)`` bins (at least ``min_num_micro_batch``) and adds bins until
    every bin fits the budget; a sequence longer than the budget alone is accepted in a bin of its own.
    Returns non-empty bins, each with ascending indices, in decreasing order of token sum.
    """
    if max_token_len <= 0:
        raise ValueError(f"max_token_len must be positive, got {max_token_len}")
    n = len(seqlens)
    if n == 0:
        return []
    num_bins = max(1, math.ceil(sum(seqlens) / max_token_len), min_num_micro_batch or 1)
    if num_bins > n:
        if min_num_micro_batch is not None and min_num_micro_batch > n:
            raise ValueError(f"min_num_micro_batch={min_num_micro_batch} exceeds the {n} rows available")
        num_bins = n
    while True:
        bins = get_seqlen_balanced_partitions(seqlens, num_bins, equal_size=False)
        fits = all(len(b) == 1 or sum(seqlens[i] for i in b) <= max_token_len for b in bins)
        if fits or num_bins == n:
            return bins
        num_bins += 1


def get_reverse_idx(idx_map: list[int]) -> list[int]:
    """The inverse permutation: ``reverse[idx_map[i]] = i``, to restore the original row order."""
    reverse = [0] * len(idx_map)
    for position, idx in enumerate(idx_map):
        reverse[idx] = position
    return reverse


# ---------------------------------------------------------------------------------------------------
# verl's token-budget micro-batching API (``rearrange_micro_batches`` and friends)


def ceildiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers: ``ceildiv(7, 3) == 3``."""
    return -(a // -b)


def roundup_divisible(a: int, b: int) -> int:
    """The smallest multiple of ``b`` that is ``>= a``: ``roundup_divisible(7, 4) == 8``."""
    return ceildiv(a, b) * b


def calculate_workload(seqlen_list: torch.Tensor) -> torch.Tensor:
    """Relative cost of a forward/backward over sequences of these lengths, as verl estimates it.

    A dense block costs ``~12 h^2 s + 2 h s^2`` FLOPs; with verl's calibration ``h = 4096`` this is
    proportional to ``24576 s + s^2``, so the attention term only matters for long sequences."""
    return 24576 * seqlen_list + seqlen_list**2


def _effective_seqlens(batch: TensorDict) -> tuple[torch.Tensor, int]:
    """``(tokens per row (B,), padded width)``; jagged ``input_ids`` count their own lengths."""
    input_ids = batch.get("input_ids", None)
    if isinstance(input_ids, torch.Tensor) and input_ids.is_nested:
        lengths = input_ids.offsets().diff()
        return lengths, int(lengths.max())
    mask = batch["attention_mask"]
    return mask.sum(dim=1), mask.shape[-1]


def _max_over_group(count: int, dp_group) -> int:
    """All-reduce(max) of ``count`` over ``dp_group`` (on the process's device: NCCL reduces device
    tensors only)."""
    from hybridflow.utils.device import current_device

    device = current_device()
    value = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=dp_group)
    return int(value.item())


def rearrange_micro_batches(
    batch: TensorDict,
    max_token_len: int,
    dp_group=None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
    force_group_size: int = 1,
) -> tuple[list[TensorDict], list[list[int]]]:
    """Split ``batch`` (``attention_mask (B, T)`` or jagged ``input_ids``) into micro-batches of about
    ``max_token_len`` real tokens each, with balanced compute (verl's signature and semantics).

    - count: ``min(B / force_group_size, ceil(tokens / max_token_len))``, at least ``min_num_micro_batch``,
      the max over ``dp_group`` when ``same_micro_num_in_dp`` (every rank runs the same number of
      collectives), rounded up to a multiple of ``num_batches_divided_by`` (pipeline stages);
    - rows (or blocks of ``force_group_size`` consecutive rows) are partitioned by LDM on
      :func:`calculate_workload`, so a bin may exceed ``max_token_len`` when lengths are uneven;
    - with ``use_dynamic_bsz_balance`` bins are sorted by workload, descending, then laid out
      smallest-at-both-ends (``P[::2][::-1] + P[1::2]``) to shorten pipeline warm-up and cool-down.

    Returns ``(micro_batches, indices)``: ``micro_batches[i] = batch[indices[i]]``, each index list
    ascending. Raises ValueError if a single row is wider than ``max_token_len``.
    """
    seqlens, width = _effective_seqlens(batch)
    if max_token_len < width:
        raise ValueError(f"max_token_len={max_token_len} must be >= the sequence length {width}")
    n = len(seqlens)
    if force_group_size < 1 or n % force_group_size:
        raise ValueError(f"batch size {n} is not divisible by force_group_size={force_group_size}")
    num_groups = n // force_group_size
    count = min(num_groups, ceildiv(int(seqlens.sum()), max_token_len))
    count = max(count, min_num_micro_batch or 0)
    if dist.is_initialized() and same_micro_num_in_dp and dp_group is not None:
        count = _max_over_group(count, dp_group)
    if num_batches_divided_by is not None:
        count = roundup_divisible(count, num_batches_divided_by)
    if count > num_groups:
        raise ValueError(f"{count} micro-batches requested but only {num_groups} rows/groups to fill them")

    workloads = calculate_workload(seqlens.long()).view(num_groups, force_group_size).sum(dim=1).tolist()
    group_bins = get_seqlen_balanced_partitions(workloads, count, equal_size=False)
    if use_dynamic_bsz_balance:
        group_bins.sort(key=lambda b: (sum(workloads[g] for g in b), b[0]), reverse=True)
        group_bins = group_bins[::2][::-1] + group_bins[1::2]
    indices = [[g * force_group_size + j for g in b for j in range(force_group_size)] for b in group_bins]
    return [_index_rows(batch, idx) for idx in indices], indices


def _index_rows(batch: TensorDict, idx: list[int]) -> TensorDict:
    """Rows ``idx`` of ``batch``; jagged tensors are re-packed row by row."""
    from tensordict import TensorDict

    index = torch.tensor(idx, dtype=torch.long)
    rows = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            rows[key] = torch.nested.as_nested_tensor([value[i] for i in idx], layout=torch.jagged)
        else:
            rows[key] = value[index]
    return TensorDict(rows, batch_size=[len(idx)])


def prepare_dynamic_batch(
    data: DataProto,
    max_token_len: int,
    dp_group=None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
) -> tuple[list[DataProto], list[list[int]]]:
    """:func:`rearrange_micro_batches` on a DataProto: micro-batch DataProtos (non-tensor columns
    indexed alike, each with its own copy of meta_info) and the index lists to undo it with."""
    from hybridflow.protocol import DataProto

    batches, indices = rearrange_micro_batches(
        data.batch,
        max_token_len=max_token_len,
        dp_group=dp_group,
        num_batches_divided_by=num_batches_divided_by,
        same_micro_num_in_dp=same_micro_num_in_dp,
        min_num_micro_batch=min_num_micro_batch,
        use_dynamic_bsz_balance=use_dynamic_bsz_balance,
    )
    micro_batches = [
        DataProto(
            batch=td,
            non_tensor_batch={k: v[idx] for k, v in data.non_tensor_batch.items()},
            meta_info=copy.deepcopy(data.meta_info),
        )
        for td, idx in zip(batches, indices, strict=True)
    ]
    return micro_batches, indices


def restore_dynamic_batch(data: torch.Tensor, batch_idx_list: list[list[int]]) -> torch.Tensor:
    """Rows of ``data`` (concatenated micro-batch outputs) back in the original order."""
    order = [i for idx in batch_idx_list for i in idx]
    if len(order) != data.shape[0]:
        raise ValueError(f"restore_dynamic_batch: {len(order)} indices for {data.shape[0]} rows")
    reverse = torch.tensor(get_reverse_idx(order), dtype=torch.long)
    if data.is_nested:
        rows = data.unbind()
        return torch.nested.as_nested_tensor([rows[i] for i in reverse], layout=torch.jagged)
    return data[reverse]


def get_group_balanced_partitions(
    seqlen_list: list[int], uid_list: list, k_partitions: int
) -> list[list[int]]:
    """``k_partitions`` index lists with balanced workload, never splitting a run of equal uids.

    Consecutive rows with the same uid (the ``n`` responses of one prompt) form a group; groups are
    partitioned by LDM on summed :func:`calculate_workload` with an equal number of groups per
    partition (so equal row counts when every prompt has ``n`` responses). Each list is ascending.
    """
    if len(seqlen_list) != len(uid_list):
        raise ValueError(f"{len(seqlen_list)} seqlens but {len(uid_list)} uids")
    groups: list[list[int]] = []
    for i, uid in enumerate(uid_list):
        if groups and uid_list[groups[-1][0]] == uid:
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) < k_partitions:
        raise ValueError(f"{len(groups)} uid groups cannot fill {k_partitions} partitions")
    lengths = torch.tensor(seqlen_list, dtype=torch.int64)
    workloads = [int(calculate_workload(lengths[g]).sum()) for g in groups]
    parts = get_seqlen_balanced_partitions(workloads, k_partitions, equal_size=True)
    return [sorted(i for g in part for i in groups[g]) for part in parts]
