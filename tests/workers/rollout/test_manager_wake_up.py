"""The agent-loop manager starts the chunks' loops while the replicas wake up
(:meth:`~hybridflow.workers.rollout.agent_loop.manager.AgentLoopManager.generate_sequences`).

Real Ray processes: two scripted replicas (:mod:`tests.workers.rollout.elastic_workers`), the real
servers and serve loops, an agent-loop worker that sends one request per row through the real server
manager. A wake-up that raises must not leave the loops (already waiting on the servers) hanging: the
call raises the wake-up's error, every row's request ends with the replica's error, and the servers
take requests again at the next call, whose requests (sent before the replicas serve) all finish.
"""

from __future__ import annotations

import time

import numpy as np
import pytest


@pytest.fixture
def manager(ray_session):
    import ray

    from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.workers.rollout.elastic_workers import ChunkClient, WakeFailingReplica, bare_manager

    replicas = RayWorkerGroup(
        RayResourcePool([2], name_prefix="wake_rollout"),
        RayClassWithInitArgs(WakeFailingReplica),
        name_prefix="wake_rollout",
    )
    replicas.init_model()
    manager = bare_manager(replicas, ChunkClient)
    yield manager
    for actor in [*manager.servers, *manager.workers]:
        ray.kill(actor)
    replicas.shutdown()


def test_a_failed_wake_up_ends_the_waiting_loops_and_the_next_call_serves(manager):
    import ray

    from hybridflow.protocol import DataProto

    batch = DataProto.from_dict(non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    start = time.monotonic()
    with pytest.raises(Exception, match="the KV cache does not fit"):
        manager.generate_sequences(batch)
    assert time.monotonic() - start < 30, "the loops waiting on the servers held the call"
    outcomes = ray.get(manager.workers[0].last_outcomes.remote())
    assert outcomes == ["ReplicaError"] * 4, outcomes

    manager.worker_group.set_fail_wake(False)
    served = ray.get(manager.workers[0].generate_sequences.remote(batch[:0]))  # the servers are not failed
    assert len(served) == 0
    manager._open_servers()
    chunk_ref = manager.workers[0].generate_sequences.remote(batch)  # requests queue before serving
    time.sleep(0.2)
    _, serve_refs = manager.start_serving(rows=4, opened=True)
    try:
        ray.get(chunk_ref, timeout=60)
    finally:
        stats = manager.stop_serving(serve_refs)
    assert ray.get(manager.workers[0].last_outcomes.remote()) == ["4 tokens"] * 4
    assert sum(s["requests"] for s in stats) == 4
