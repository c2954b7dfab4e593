"""Controller smoke run (the README's main command until the quickstart trainer lands).

Starts a local Ray, spawns a 2-worker group whose workers join a gloo process group and hold one
shard each of a small linear model's data-parallel step, and shows one DP_COMPUTE_PROTO round trip:
dispatch (auto-padded), per-rank compute with an all-reduce, collect, unpad.
"""

import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import ray  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hybridflow.protocol import DataProto  # noqa: E402
from hybridflow.single_controller import Dispatch, Worker, register  # noqa: E402
from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402


class LinearRegressionWorker(Worker):
    """Data-parallel least squares: each rank computes the gradient on its shard, all-reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.init_process_group()
        torch.manual_seed(0)
        self.weight = torch.zeros(4)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def train_step(self, data: DataProto) -> DataProto:
        x, y = data.batch["x"], data.batch["y"]
        residual = x @ self.weight - y
        grad = x.T @ residual
        dist.all_reduce(grad)
        self.weight -= 0.002 * grad
        loss = (residual**2).mean().reshape(1)
        dist.all_reduce(loss)
        return DataProto.from_dict(
            {"residual": residual}, meta_info={"metrics": {"loss": loss.item() / self.world_size}}
        )


def main() -> None:
    start = time.time()
    ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False)
    pool = RayResourcePool([2], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(LinearRegressionWorker), name_prefix="demo")
    print(f"worker group up: {wg.world_size} workers, pids {wg.worker_pids} ({time.time() - start:.1f}s)")
    true_w = torch.tensor([1.0, -2.0, 0.5, 3.0])
    x = torch.randn(63, 4)  # 63 rows over 2 ranks: auto-padded to 64, unpadded on return
    batch = DataProto.from_dict({"x": x, "y": x @ true_w}, auto_padding=True)
    for step in range(30):
        out = wg.train_step(batch)
        if step % 10 == 0 or step == 29:
            print(f"step {step:2d}  loss {out.meta_info['metrics']['loss'][0]:.4f}  rows back {len(out)}")
    ray.shutdown()
    print(f"demo finished in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
