"""verl's statistics over ranks (distributed_mean_max_min_std, distributed_masked_mean) on two gloo
processes, and expand_as_nested. Expected numbers are worked out by hand in the comments."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.utils.device import get_nccl_backend, get_torch_device
from hybridflow.utils.torch_functional import (
    distributed_masked_mean,
    distributed_mean_max_min_std,
    expand_as_nested,
)


def _ranks(rank: int, world_size: int, init_file: str) -> None:
    get_torch_device().set_device(rank)  # device-agnostic verl code: a no-op on the CPU
    dist.init_process_group(
        get_nccl_backend(), init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        # rank 0 holds [1, 2], rank 1 holds [4]: N = 3, mean 7 / 3, max 4, min 1,
        # std = sqrt(((1 - 7/3)^2 + (2 - 7/3)^2 + (4 - 7/3)^2) / 2) = sqrt((42/9) / 2) = sqrt(7/3)
        local = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([4.0])
        mean, gmax, gmin, std = distributed_mean_max_min_std(local)
        assert math.isclose(mean.item(), 7 / 3, rel_tol=1e-6) and gmax.item() == 4.0 and gmin.item() == 1.0
        assert math.isclose(std.item(), math.sqrt(7 / 3), rel_tol=1e-6)
        assert distributed_mean_max_min_std(local, False, False, False)[1:] == (None, None, None)
        # masked: rank 0 keeps 1 (NaN masked out), rank 1 keeps 4 and 6 -> (1 + 4 + 6) / 3
        values = torch.tensor([1.0, float("nan")]) if rank == 0 else torch.tensor([4.0, 6.0])
        mask = torch.tensor([1.0, 0.0]) if rank == 0 else torch.tensor([1.0, 1.0])
        assert math.isclose(distributed_masked_mean(values, mask).item(), 11 / 3, rel_tol=1e-6)
    finally:
        dist.destroy_process_group()


def test_statistics_over_two_gloo_ranks(tmp_path):
    mp.spawn(_ranks, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)


def test_expand_as_nested_fills_each_row_with_its_value():
    rows = torch.nested.as_nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    out = expand_as_nested(torch.tensor([1, 2]), rows)
    assert [r.tolist() for r in out.unbind()] == [[1, 1], [2, 2, 2]]
    assert torch.equal(out.offsets(), rows.offsets())
    for bad in (
        lambda: expand_as_nested(torch.tensor([1, 2]), torch.zeros(2, 3)),  # not nested
        lambda: expand_as_nested(torch.tensor([1, 2, 3]), rows),  # 3 values, 2 rows
        lambda: expand_as_nested(torch.tensor([[1, 2]]), rows),  # not 1-D
    ):
        with pytest.raises(AssertionError):
            bad()
