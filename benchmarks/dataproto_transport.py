"""Ray round-trip time of a DataProto vs the same tensors pickled the default (torch) way.

Prints one JSON line: seconds per round trip (driver -> actor -> driver) for each encoding.
"""

import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import ray  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from hybridflow.protocol import DataProto  # noqa: E402


@ray.remote(num_cpus=1)
class Echo:
    def echo(self, value):
        return value


def _time(actor, value, repeats: int) -> float:
    ray.get(actor.echo.remote(value))  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        ray.get(actor.echo.remote(value))
    return (time.perf_counter() - start) / repeats


def main(rows: int = 1024, seq: int = 1024, repeats: int = 5) -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    tensors = {
        "input_ids": torch.randint(0, 32000, (rows, seq)),
        "attention_mask": torch.ones(rows, seq, dtype=torch.int64),
        "old_log_probs": torch.randn(rows, seq // 2),
        "advantages": torch.randn(rows, seq // 2),
    }
    mbytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    actor = Echo.remote()
    dataproto_s = _time(actor, DataProto.from_dict(tensors), repeats)
    tensordict_s = _time(actor, TensorDict(tensors, batch_size=[rows]), repeats)
    print(
        json.dumps(
            {
                "benchmark": "dataproto_transport",
                "payload_mb": round(mbytes, 1),
                "dataproto_roundtrip_s": round(dataproto_s, 4),
                "tensordict_default_roundtrip_s": round(tensordict_s, 4),
                "speedup": round(tensordict_s / dataproto_s, 2),
            }
        )
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
