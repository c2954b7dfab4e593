"""A multi-node Ray cluster on one machine, for trying and testing multi-node runs::

    python -m hybridflow.placement.local_cluster --nodes 2 --cpus-per-node 2 [--gpus-per-node G]
        [--address-file F] [--fast-failure-detection]

Starts a head node and ``--nodes - 1`` more raylets (Ray's ``cluster_utils.Cluster``: each "node" has
its own raylet, object store and resources, so Ray schedules across them as across machines), prints
``address: HOST:PORT`` and waits. Point runs at it with ``ray_init.address=HOST:PORT``. SIGTERM or
SIGINT shuts the cluster down; SIGUSR1 kills the newest non-head node without warning (its raylet
and every worker on it), as a machine that dies mid-run. It never touches other Ray instances.
``--gpus-per-node`` gives the nodes other than the head that many *logical* GPUs (Ray resources, no
device behind them): a GPU cluster whose head node has none, for placement tests.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def start_cluster(nodes: int, cpus_per_node: int, system_config: dict | None = None, gpus_per_node: int = 0):
    """A started ``Cluster`` with ``nodes`` nodes of ``cpus_per_node`` logical CPUs each (and
    ``gpus_per_node`` logical GPUs on every node but the head)."""
    from ray.cluster_utils import Cluster

    from hybridflow.utils.ray_startup import LOCAL_RAY_SYSTEM_CONFIG

    head_args = {
        "num_cpus": cpus_per_node,
        "include_dashboard": False,
        "_system_config": {**LOCAL_RAY_SYSTEM_CONFIG, **(system_config or {})},
    }
    cluster = Cluster(initialize_head=True, head_node_args=head_args, shutdown_at_exit=False)
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node)
    cluster.wait_for_nodes()
    return cluster


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=2, help="logical CPUs (Ray resources) per node")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="logical GPUs on each non-head node")
    parser.add_argument("--address-file", default=None, help="also write the address here")
    parser.add_argument(
        "--fast-failure-detection",
        action="store_true",
        help="declare a silent node dead after ~3 s instead of Ray's default ~30 s (tests)",
    )
    args = parser.parse_args(argv)
    system_config = None
    if args.fast_failure_detection:
        system_config = {"health_check_period_ms": 500, "health_check_failure_threshold": 5}
    cluster = start_cluster(args.nodes, args.cpus_per_node, system_config, args.gpus_per_node)
    stop = threading.Event()
    lose_node = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: lose_node.set())
    if args.address_file:
        with open(args.address_file + ".tmp", "w") as f:
            f.write(cluster.address)
        os.replace(args.address_file + ".tmp", args.address_file)
    print(f"address: {cluster.address}", flush=True)
    try:
        while not stop.wait(0.1):
            if lose_node.is_set():
                lose_node.clear()
                workers = list(cluster.worker_nodes)
                if workers:
                    node = workers[-1]
                    cluster.remove_node(node, allow_graceful=False)
                    print(f"lost node {node.unique_id}", flush=True)
    finally:
        cluster.shutdown()
        print("cluster shut down", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
