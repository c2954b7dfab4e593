"""Worker groups on separate resource pools run at the same time; roles colocated on one pool queue.
``wait_futures`` waits on calls of several groups together and surfaces the first failure at once."""

import os
import pickle
import signal
import time

import pytest
import ray
import torch

from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    create_colocated_worker_cls,
    wait_futures,
)
from tests.single_controller.workers import NapWorker

NAP_S = 1.0


def _rows(n: int = 2) -> DataProto:
    return DataProto.from_dict({"x": torch.zeros(n, 1)}, meta_info={"seconds": NAP_S})


def _interval(result: DataProto) -> tuple[float, float]:
    return float(result.batch["start"].min()), float(result.batch["end"].max())


@pytest.fixture(scope="module")
def two_pools(ray_session):
    """One NapWorker process on each of two pools."""
    groups = [
        RayWorkerGroup(
            RayResourcePool([1], name_prefix=name), RayClassWithInitArgs(NapWorker), name_prefix=name
        )
        for name in ("pool_a", "pool_b")
    ]
    yield groups
    for group in groups:
        group.shutdown()


@pytest.fixture(scope="module")
def one_pool(ray_session):
    """Two roles colocated in one process (one pool)."""
    cls = create_colocated_worker_cls(
        {"a": RayClassWithInitArgs(NapWorker), "b": RayClassWithInitArgs(NapWorker)}
    )
    base = RayWorkerGroup(RayResourcePool([1], name_prefix="shared"), cls, name_prefix="shared")
    yield base.spawn(["a", "b"])
    base.shutdown()


def test_calls_on_two_pools_overlap(two_pools):
    a, b = two_pools
    wait_futures([a.nap_async(_rows()), b.nap_all_async(0.01)])  # both processes up before timing
    start = time.monotonic()
    ready_order = []
    out_a, out_b = wait_futures([a.nap_async(_rows()), b.nap_all_async(NAP_S)], on_ready=ready_order.append)
    wall = time.monotonic() - start
    (a0, a1), (b0, b1) = _interval(out_a), out_b[0]
    assert max(a0, b0) < min(a1, b1), "the two pools' calls did not run at the same time"
    assert NAP_S <= wall < 1.6 * NAP_S
    assert sorted(ready_order) == [0, 1]
    assert out_a.batch["start"].shape == (2,)  # the DataProto result is assembled as a blocking call's


def test_roles_on_one_pool_queue_in_submission_order(one_pool):
    wait_futures([one_pool["a"].nap_all_async(0.01)])
    start = time.monotonic()
    out_a, out_b = wait_futures([one_pool["a"].nap_async(_rows()), one_pool["b"].nap_async(_rows())])
    wall = time.monotonic() - start
    a_end, b_start = _interval(out_a)[1], _interval(out_b)[0]
    assert a_end <= b_start, "colocated roles ran at the same time in one process"
    assert wall >= 2 * NAP_S


def test_a_future_passed_whole_to_another_group_travels_as_a_plain_future(two_pools):
    a, _ = two_pools
    future = a.nap_async(DataProto.from_dict({"x": torch.zeros(2, 1)}, meta_info={"seconds": 0.0}))
    clone = pickle.loads(ray.cloudpickle.dumps(future))
    assert type(clone) is DataProtoFuture and len(clone.get()) == 2


def test_a_dead_worker_is_reported_at_once_while_another_pool_still_works(ray_session, two_pools):
    doomed = RayWorkerGroup(RayResourcePool([1]), RayClassWithInitArgs(NapWorker), name_prefix="doomed_pool")
    try:
        pid = doomed.worker_pids[0]
        futures = [two_pools[0].nap_all_async(6.0), doomed.nap_all_async(60.0)]
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"'doomed_pool' rank 0 \(pid \d+\) died during 'nap_all'"):
            wait_futures(futures)
        assert time.monotonic() - start < 5  # not after the other pool's 6 s call
    finally:
        doomed.shutdown()


def test_a_pool_asking_for_more_nodes_than_the_cluster_has_fails_clearly(ray_session):
    pool = RayResourcePool([1, 1], ready_timeout_s=5)
    with pytest.raises(RuntimeError, match=r"asks for 2 nodes .* the Ray cluster has 1 alive node"):
        pool.get_placement_groups()
