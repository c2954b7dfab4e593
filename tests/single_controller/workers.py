"""Worker classes used by the single-controller tests (importable by the Ray worker processes)."""

import os
import time

import torch
import torch.distributed as dist

from hybridflow.protocol import DataProto
from hybridflow.single_controller import (
    Dispatch,
    Execute,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)


class DPWorker(Worker):
    """Joins a real gloo process group; its methods exercise each dispatch mode."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self.backend = self.init_process_group()
        self.last_seen: list[float] = []
        # Two views of the same 2 processes: "dp" (one shard per rank), "tp" (one tensor-parallel group
        # of both ranks: same shard, only rank 0 returns it).
        self.register_dispatch_collect_info("dp", dp_rank=self.rank, is_collect=True)
        self.register_dispatch_collect_info("tp", dp_rank=0, is_collect=self.rank == 0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "dist_rank": dist.get_rank(),
            "backend": self.backend,
            "master": f"{self.master_addr}:{self.master_port}",
            "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "pid": os.getpid(),
        }

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute(self, data: DataProto) -> DataProto:
        """y = scale * x; ``global_sum`` is an all-reduce of every rank's shard sum."""
        x = data.batch["x"].float()
        total = x.sum().reshape(1)
        dist.all_reduce(total)
        self.last_seen = x.flatten().tolist()
        n = len(data)
        return DataProto.from_dict(
            tensors={
                "y": x * self.scale,
                "rank": torch.full((n,), self.rank),
                "global_sum": total.expand(n).clone(),
            },
            non_tensors={"tag": data.non_tensor_batch["tag"]},
            meta_info={"metrics": {"shard_size": n}},
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double_y(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y2": data.batch["y"] * 2})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": fn(data.batch["x"])})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def shard_stats(self, data: DataProto) -> dict:
        return {"rank": self.rank, "n": len(data)}

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def add(self, a: int, b: int) -> int:
        return a + b + 100 * self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def echo(self, value):
        return (self.rank, value)

    @register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def seen(self) -> list[float]:
        return self.last_seen

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("tp"))
    def tp_compute(self, data: DataProto) -> DataProto:
        self.last_seen = data.batch["x"].flatten().tolist()
        return DataProto.from_dict({"y": data.batch["x"] + 1, "rank": torch.full((len(data),), self.rank)})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("dp"))
    def dp_mesh_compute(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"rank": torch.full((len(data),), self.rank)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail(self, message: str):
        if self.rank == 1:
            raise ValueError(message)
        return self.rank


class SleepyWorker(Worker):
    """No process group: used to kill a worker in the middle of a call."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


class ActorRole(Worker):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> tuple:
        return (self.name, os.getpid(), self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def forward(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"out": data.batch["x"] * 10})


class CriticRole(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> tuple:
        return ("critic", os.getpid(), self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def values(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"v": data.batch["x"] - 1})


class NapWorker(Worker):
    """No process group: naps and reports when (wall clock), to see calls overlap or queue."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def nap(self, data: DataProto) -> DataProto:
        start = time.time()
        time.sleep(float(data.meta_info["seconds"]))
        n = len(data)
        return DataProto.from_dict(
            {
                "start": torch.full((n,), start, dtype=torch.float64),
                "end": torch.full((n,), time.time(), dtype=torch.float64),
            }
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap_all(self, seconds: float) -> tuple[float, float]:
        start = time.time()
        time.sleep(seconds)
        return start, time.time()
