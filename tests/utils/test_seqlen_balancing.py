import itertools
import random

import pytest

from hybridflow.utils.seqlen_balancing import (
    get_reverse_idx,
    get_seqlen_balanced_partitions,
    karmarkar_karp,
    log_seqlen_unbalance,
    rearrange_micro_batches_indices,
)


def _sums(seqlens, partitions):
    return [sum(seqlens[i] for i in p) for p in partitions]


def _optimal_max_sum(seqlens, k, equal_size):
    """Brute force over all assignments of items to k non-empty (or equal-size) partitions."""
    best = None
    for assign in itertools.product(range(k), repeat=len(seqlens)):
        counts = [assign.count(j) for j in range(k)]
        if (equal_size and len(set(counts)) != 1) or min(counts) == 0:
            continue
        sums = [0] * k
        for i, j in enumerate(assign):
            sums[j] += seqlens[i]
        best = max(sums) if best is None else min(best, max(sums))
    return best


def test_hand_example():
    # The textbook LDM run on {8,7,6,5,4}: 8-7 -> 1, 6-5 -> 1, then {4,1,1}: 4-1 -> 3, 3-1 -> 2.
    # Sums 16 / 14 ({8,6} vs {7,5,4}), although 15 / 15 exists: LDM is a heuristic.
    partitions = get_seqlen_balanced_partitions([8, 7, 6, 5, 4], 2, equal_size=False)
    assert sorted(_sums([8, 7, 6, 5, 4], partitions)) == [14, 16]
    assert sorted(partitions) == [[0, 2], [1, 3, 4]]
    assert all(p == sorted(p) for p in partitions)


@pytest.mark.parametrize("equal_size", [False, True])
def test_cover_each_index_once(equal_size):
    rng = random.Random(1)
    seqlens = [rng.randint(1, 500) for _ in range(24)]
    partitions = get_seqlen_balanced_partitions(seqlens, 4, equal_size)
    assert sorted(i for p in partitions for i in p) == list(range(24))
    assert all(p for p in partitions)
    if equal_size:
        assert [len(p) for p in partitions] == [6, 6, 6, 6]


def test_equal_size_requires_divisible():
    with pytest.raises(ValueError, match="equal parts"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match="non-empty"):
        get_seqlen_balanced_partitions([1, 2], 3, equal_size=False)


def test_quality_vs_brute_force():
    """Tolerances: LDM's proven ratio 4/3 - 1/(3k) without size constraint (Michiels et al. 2007);
    with equal sizes, an additive one item length (observed worst case over 300 draws: 0.11 x max)."""
    rng = random.Random(0)
    for _ in range(40):
        k = rng.choice([2, 3])
        n = 6 if k == 3 else rng.choice([6, 8])
        seqlens = [rng.randint(1, 100) for _ in range(n)]
        free = max(_sums(seqlens, get_seqlen_balanced_partitions(seqlens, k, False)))
        assert free <= (4 / 3 - 1 / (3 * k)) * _optimal_max_sum(seqlens, k, False) + 1e-9
        equal = max(_sums(seqlens, get_seqlen_balanced_partitions(seqlens, k, True)))
        assert equal <= _optimal_max_sum(seqlens, k, True) + max(seqlens)


def test_log_seqlen_unbalance_keys():
    seqlens = [10, 1, 9, 2]
    metrics = log_seqlen_unbalance(seqlens, [[0, 1], [2, 3]], prefix="global_seqlen")
    # Contiguous split: [10, 1] -> 11, [9, 2] -> 11; given partitions: 11 and 11.
    assert metrics == {
        "global_seqlen/min": 11,
        "global_seqlen/max": 11,
        "global_seqlen/minmax_diff": 0,
        "global_seqlen/balanced_min": 11,
        "global_seqlen/balanced_max": 11,
        "global_seqlen/mean": 11.0,
    }
    metrics = log_seqlen_unbalance([10, 9, 1, 2], [[0, 3], [1, 2]])
    assert metrics["global_seqlen/minmax_diff"] == 19 - 3
    assert (metrics["global_seqlen/balanced_min"], metrics["global_seqlen/balanced_max"]) == (10, 12)


def test_micro_batches_respect_budget():
    rng = random.Random(2)
    for _ in range(30):
        seqlens = [rng.randint(1, 60) for _ in range(rng.randint(1, 20))]
        bins = rearrange_micro_batches_indices(seqlens, max_token_len=64)
        assert sorted(i for b in bins for i in b) == list(range(len(seqlens)))
        assert all(b and b == sorted(b) for b in bins)
        assert all(sum(seqlens[i] for i in b) <= 64 for b in bins)
        assert len(bins) >= -(-sum(seqlens) // 64)


def test_micro_batches_oversized_and_minimum():
    bins = rearrange_micro_batches_indices([5, 100, 3, 4], max_token_len=12)
    assert [1] in bins  # the over-budget sequence sits alone
    assert all(sum([5, 100, 3, 4][i] for i in b) <= 12 for b in bins if b != [1])
    assert len(rearrange_micro_batches_indices([1, 1, 1, 1], 100, min_num_micro_batch=3)) == 3
    with pytest.raises(ValueError):
        rearrange_micro_batches_indices([1, 1], 100, min_num_micro_batch=3)
    assert rearrange_micro_batches_indices([], 10) == []


def test_reverse_idx_restores_order():
    bins = rearrange_micro_batches_indices([7, 3, 9, 1, 4, 8], max_token_len=12)
    order = [i for b in bins for i in b]
    reverse = get_reverse_idx(order)
    rows = ["r0", "r1", "r2", "r3", "r4", "r5"]
    permuted = [rows[i] for i in order]
    assert [permuted[j] for j in reverse] == rows
    assert get_reverse_idx([2, 0, 1]) == [1, 2, 0]
