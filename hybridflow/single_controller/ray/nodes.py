"""The Ray cluster's nodes as resource pools see them: which nodes can host a pool, in a fixed order,
and whether a node is still part of the cluster.

A pool asks for ``process_on_nodes[i]`` workers on "node ``i``". On a one-node cluster every entry
lands on that node (as before). On a multi-node cluster node ``i`` is the ``i``-th node of
:func:`schedulable_nodes` for every pool, so two pools' "node 0" are the same machine and a config
that sums the pools' workers per node means what it says. A node without the bundle's resources
(a head node without GPUs in a GPU run) is never picked, and the driver never looks for a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

NODE_ID_LABEL = "ray.io/node-id"  # Ray's built-in label on every node (Ray >= 2.45)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    alive: bool

    def describe(self) -> str:
        return f"{self.ip} (node id {self.node_id[:12]})"


def _covers(resources: dict, bundle: dict[str, float]) -> bool:
    return all(resources.get(key, 0.0) >= amount for key, amount in bundle.items())


def schedulable_nodes(bundle: dict[str, float]) -> list[NodeInfo]:
    """Alive nodes whose total resources hold at least one ``bundle``: the driver's node first (when
    it qualifies), then the others by node id, so the order is the same for every pool of a run."""
    driver = ray.get_runtime_context().get_node_id()
    nodes = [
        NodeInfo(n["NodeID"], n["NodeManagerAddress"], True)
        for n in ray.nodes()
        if n["Alive"] and _covers(n.get("Resources", {}), bundle)
    ]
    return sorted(nodes, key=lambda n: (n.node_id != driver, n.node_id))


def node_info(node_id: str) -> NodeInfo | None:
    """What the cluster (GCS) says about ``node_id`` now; None if it never heard of it."""
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return NodeInfo(node_id, n["NodeManagerAddress"], bool(n["Alive"]))
    return None


def pin_to_node(node_id: str, bundles: int) -> dict:
    """Placement-group options that put all ``bundles`` on ``node_id``."""
    return {"bundle_label_selector": [{NODE_ID_LABEL: node_id}] * bundles}


# A collective failing with one of these means a peer went away (gloo / NCCL / socket wording).
LOST_PEER_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "NCCL communicator was aborted",
)
# How long the driver waits, after a peer-loss error, for Ray to say which worker (or node) is gone:
# Ray declares a silent node dead after its health checks fail (~15-30 s with Ray's defaults).
DEAD_PEER_GRACE_S = 60.0


def looks_like_lost_peer(error: BaseException | str) -> bool:
    text = str(error)
    return any(marker in text for marker in LOST_PEER_MARKERS)


def find_dead_worker(
    workers: list, rank_node_ids: list[str] | None, timeout_s: float = DEAD_PEER_GRACE_S
) -> tuple[int, NodeInfo | None] | None:
    """After a peer-loss error: ``(rank, node)`` of a worker that is gone (``node.alive`` False when
    its whole node left the cluster), or None when every worker answers twice in a row (or nothing is
    decided within ``timeout_s``).

    Every worker is pinged every half second. A worker whose node died may answer once more before it
    exits, then is "unavailable" until Ray declares the node dead (health checks) and the actor dead
    with it; a node declared dead settles it at once."""
    import time

    answered = [0] * len(workers)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        round_start = time.monotonic()
        pings = {workers[r].__ray_ready__.remote(): r for r in range(len(workers)) if answered[r] < 2}
        if not pings:
            return None
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=2.0)
        for ref in ready:
            rank = pings[ref]
            try:
                ray.get(ref)
                answered[rank] += 1
            except ray.exceptions.ActorUnavailableError:
                answered[rank] = 0  # not decided yet: ask again
            except ray.exceptions.RayActorError:
                return rank, node_info(rank_node_ids[rank]) if rank_node_ids else None
        for ref in set(pings) - set(ready):
            answered[pings[ref]] = 0
        for rank, node_id in enumerate(rank_node_ids or []):
            node = node_info(node_id)
            if node is not None and not node.alive:
                return rank, node
        time.sleep(max(0.0, 0.5 - (time.monotonic() - round_start)))
    return None
