"""A real 2-worker Ray group on CPU whose workers form a gloo process group."""

import os
import signal
import time

import pytest
import torch

from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    create_colocated_worker_cls,
)
from tests.single_controller.workers import ActorRole, CriticRole, DPWorker, SleepyWorker


def _batch(n: int, auto_padding: bool = True) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float32).reshape(n, 1)},
        non_tensors={"tag": [f"row{i}" for i in range(n)]},
        auto_padding=auto_padding,
    )


@pytest.fixture(scope="module")
def dp_group(ray_session):
    pool = RayResourcePool([2], use_gpu=False, cpus_per_process=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(DPWorker, scale=3.0), name_prefix="dp_test")
    yield wg
    wg.shutdown()


def test_workers_form_a_gloo_group_with_env(dp_group):
    infos = dp_group.describe()
    assert [i["rank"] for i in infos] == [0, 1]
    assert [i["dist_rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2}
    assert {i["backend"] for i in infos} == {"gloo"}
    assert infos[0]["master"] == infos[1]["master"] and infos[0]["master"].startswith("127.0.0.1:")
    assert {i["threads"] for i in infos} == {1}
    assert {i["omp_wait_policy"] for i in infos} == {"PASSIVE"}
    assert infos[0]["pid"] != infos[1]["pid"] != os.getpid()


def test_cpu_workers_compute_on_the_cpu_and_see_no_gpu(dp_group):
    # trainer.device=cpu on a GPU host: the pool's workers get HYBRIDFLOW_DEVICE=cpu and no visible GPU,
    # so they pick gloo and CPU tensors (Ray does not hide GPUs from zero-GPU actors by itself).
    envs = dp_group.execute_all(
        "execute_fn",
        lambda worker: (
            os.environ.get("HYBRIDFLOW_DEVICE"),
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            worker.device_type(),
            str(worker.compute_device),
        ),
    )
    assert envs == [("cpu", "", "cpu", "cpu")] * 2
    assert dp_group.device_names == ["cpu", "cpu"]


def test_dp_compute_proto_pads_shards_allreduces_and_unpads(dp_group):
    data = _batch(5)  # 5 rows over 2 ranks: padded to 6 (row 0 repeated), 3 per rank
    out = dp_group.compute(data)
    assert len(out) == 5
    torch.testing.assert_close(out.batch["y"], data.batch["x"] * 3.0)
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1][:5]
    # all-reduce of shard sums: rank 0 has 0+1+2, rank 1 has 3+4+0 (padding row) = 10
    assert out.batch["global_sum"].tolist() == [10.0] * 5
    assert list(out.non_tensor_batch["tag"]) == [f"row{i}" for i in range(5)]
    assert out.meta_info["metrics"] == {"shard_size": [3, 3]}
    assert dp_group.seen() == [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]


def test_indivisible_batch_without_auto_padding_is_a_clear_error(dp_group):
    with pytest.raises(ValueError, match=r"dp_test.*compute.*5 does not split into 2"):
        dp_group.compute(_batch(5, auto_padding=False))


def test_other_dispatch_modes(dp_group):
    data = _batch(4)
    assert dp_group.shard_stats(data) == [{"rank": 0, "n": 2}, {"rank": 1, "n": 2}]
    assert dp_group.add([1, 2], [10, 20]) == [11, 122]
    assert dp_group.echo(["a", "b"]) == [(0, "a"), (1, "b")]
    assert dp_group.only_rank_zero() == 0
    out = dp_group.apply(torch.neg, data)
    torch.testing.assert_close(out.batch["y"], -data.batch["x"])
    with pytest.raises(ValueError, match="list of 2 per-rank values"):
        dp_group.add(1, 2)


def test_worker_exception_names_group_rank_and_method(dp_group):
    with pytest.raises(ValueError, match="boom") as info:
        dp_group.fail("boom")
    assert any("rank 1" in note and "'fail'" in note for note in info.value.__notes__)


def test_async_calls_and_dataproto_future_chaining(dp_group):
    future = dp_group.compute_async(_batch(5))
    assert isinstance(future, DataProtoFuture)
    # The first call's output goes to the workers as a future: it never visits the controller.
    chained = dp_group.double_y(future)
    torch.testing.assert_close(chained.batch["y2"], torch.arange(5.0).reshape(5, 1) * 6.0)
    assert dp_group.shard_stats(future) == [{"rank": 0, "n": 3}, {"rank": 1, "n": 2}]
    assert len(future.get()) == 5
    pending = dp_group.describe_async()
    assert [i["rank"] for i in pending.get()] == [0, 1]


def test_mesh_aware_dispatch_shares_a_shard_and_collects_one_output(dp_group):
    data = _batch(3)
    out = dp_group.tp_compute(data)
    # one tensor-parallel group of both ranks: both receive all rows, only rank 0 is collected
    assert len(out) == 3 and out.batch["rank"].tolist() == [0, 0, 0]
    torch.testing.assert_close(out.batch["y"], data.batch["x"] + 1)
    assert dp_group.seen() == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    # the "dp" mesh of the same processes: one shard per rank, both collected in dp order
    assert dp_group.dp_mesh_compute(_batch(4)).batch["rank"].tolist() == [0, 0, 1, 1]


def test_colocated_roles_share_one_process(ray_session):
    class_dict = {
        "actor": RayClassWithInitArgs(ActorRole, name="actor"),
        "critic": RayClassWithInitArgs(CriticRole),
    }
    pool = RayResourcePool([2], use_gpu=False, cpus_per_process=0.5)
    base = RayWorkerGroup(pool, create_colocated_worker_cls(class_dict), name_prefix="colo")
    try:
        groups = base.spawn(prefix_set=class_dict.keys())
        actor_ids, critic_ids = groups["actor"].whoami(), groups["critic"].whoami()
        assert [a[0] for a in actor_ids] == ["actor", "actor"]
        assert [c[0] for c in critic_ids] == ["critic", "critic"]
        assert [a[1] for a in actor_ids] == [c[1] for c in critic_ids] == base.worker_pids
        data = _batch(4, auto_padding=False)
        torch.testing.assert_close(groups["actor"].forward(data).batch["out"], data.batch["x"] * 10)
        torch.testing.assert_close(groups["critic"].values(data).batch["v"], data.batch["x"] - 1)
    finally:
        base.shutdown()


def test_killed_worker_is_reported_within_seconds(ray_session):
    pool = RayResourcePool([2], use_gpu=False, cpus_per_process=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(SleepyWorker), name_prefix="doomed")
    try:
        future = wg.sleep_async(60)
        time.sleep(1.0)
        os.kill(wg.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"'doomed' rank 1 \(pid \d+\) died during 'sleep'"):
            future.get()
        assert time.monotonic() - start < 15
    finally:
        wg.shutdown()


def test_unsatisfiable_pool_fails_with_a_clear_error(ray_session):
    pool = RayResourcePool([1], use_gpu=True, ready_timeout_s=1)
    with pytest.raises(RuntimeError, match="not ready after 1"):
        pool.get_placement_groups()
