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

import heapq
import itertools
import math

__all__ = [
    "karmarkar_karp",
    "get_seqlen_balanced_partitions",
    "log_seqlen_unbalance",
    "rearrange_micro_batches_indices",
    "get_reverse_idx",
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
