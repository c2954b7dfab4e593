"""Elastic rollout replicas (:mod:`hybridflow.workers.rollout.agent_loop.elastic`).

Fast tier (the servers and scripted engines in this process, the real server manager):

- a lost replica's requests in flight go to the other replica and finish whole, counted as rerouted;
  while no replica is up, a request waits at a lost one's server for its new engine;
- past ``max_replica_restarts`` a death raises naming the replica, the count and the key; the key is
  fully_async_main's (main_ppo refuses other values than the default).

Slow tier, on real Ray processes: a trainer rank and two rollout replicas
(:mod:`tests.workers.rollout.elastic_workers`: a small plain model, a scripted engine of one token per
50 ms), the real servers, serve loops, serve-loop watcher, server manager and gloo checkpoint engine:

- a replica SIGKILLed mid-rollout: its requests in flight go to the other replica and finish whole
  (counted as rerouted), a new process takes its rank, gets the trainer's weights through the
  checkpoint engine (bitwise equal), serves again and takes new requests;
- a replica killed while the pool sleeps between phases: the next wake-up replaces it, the other one
  serves alone, and the next parameter sync loads the new process, which serves again;
- replicas that keep dying: past the limit the watcher raises naming the replica and the count.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

KIB = 1 / 1024  # in MiB


def _wait_until(condition, timeout_s: float = 30.0, what: str = "condition") -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} not reached within {timeout_s}s"
        time.sleep(0.02)


class LocalHandle:
    """An :class:`~hybridflow.workers.rollout.replica.LLMServer` of this process behind a Ray actor
    handle's interface (``handle.method.remote(...)`` gives an awaitable)."""

    def __init__(self, server) -> None:
        self._server = server

    def __getattr__(self, name: str):
        import asyncio
        from types import SimpleNamespace

        method = getattr(self._server, name)
        return SimpleNamespace(remote=lambda *args, **kwargs: asyncio.ensure_future(method(*args, **kwargs)))


async def _engine(server, steps: int = 20) -> None:
    """A replica's engine: exchanges with its server as the serve loop does, and finishes each request
    after ``steps`` steps of 10 ms with as many tokens as it asked for (cancel the task: the engine dies)."""
    import asyncio

    running: dict[str, list] = {}  # request id -> [tokens wanted, steps left]
    finished: list[dict] = []
    while True:
        reply = await server.exchange(finished, idle=not running, wait_s=0.02)
        finished = []
        for request_id, _, sampling, _ in reply["new"]:
            running[request_id] = [int(sampling["max_tokens"]), steps]
        await asyncio.sleep(0.01)
        for request_id, state in list(running.items()):
            state[1] -= 1
            if state[1] <= 0:
                del running[request_id]
                tokens = list(range(state[0]))
                finished.append(
                    {
                        "request_id": request_id,
                        "token_ids": tokens,
                        "log_probs": [0.0] * len(tokens),
                        "finish_reason": "length",
                        "weight_version": 1,
                    }
                )


def test_a_lost_replica_s_requests_are_rerouted_and_wait_for_a_new_engine_when_none_is_up():
    import asyncio

    from hybridflow.workers.rollout.agent_loop.server_manager import AsyncLLMServerManager
    from hybridflow.workers.rollout.replica import LLMServer

    async def scenario():
        servers = [LLMServer(f"replica {i}") for i in range(2)]
        engines = [asyncio.create_task(_engine(server)) for server in servers]
        manager = AsyncLLMServerManager(None, [LocalHandle(s) for s in servers], timeout_s=30)
        sampling = {"max_tokens": 5}
        calls = [
            asyncio.create_task(manager.generate(f"r{i}", prompt_ids=[1], sampling_params=sampling))
            for i in range(6)
        ]
        while [s.in_flight() for s in servers] != [3, 3]:
            await asyncio.sleep(0.005)  # both engines generating, three requests each
        # replica 1's engine dies: its server loses the requests (what the watcher does on a death)
        engines[1].cancel()
        assert await servers[1].lose("its engine process died (test)") == 3
        outputs = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert manager.rerouted == 3 and manager.down == {1}
        assert all(o.token_ids == list(range(5)) for o in outputs)  # regenerated whole on replica 0
        assert manager.sent == [6, 3]
        # replica 0 dies too: no replica up, a request waits at a lost server for its new engine
        engines[0].cancel()
        await servers[0].lose("its engine process died (test)")
        waiting = asyncio.create_task(manager.generate("w", prompt_ids=[1], sampling_params=sampling))
        await asyncio.sleep(0.2)
        assert not waiting.done() and manager.down == {0, 1}
        chosen = manager._sticky["w"]
        await servers[chosen].recover()  # its new engine serves (its weights loaded)
        engines[chosen] = asyncio.create_task(_engine(servers[chosen]))
        manager.replica_up(chosen)
        assert (await asyncio.wait_for(waiting, 10)).token_ids == list(range(5))
        # back in the balancer: the next new sample goes to it (the fewest in flight)
        assert manager._choose_server("next") == chosen
        for engine in engines:
            engine.cancel()

    asyncio.run(scenario())


def test_past_the_limit_a_death_raises_naming_the_replica_and_the_count():
    from types import SimpleNamespace

    from hybridflow.workers.rollout.agent_loop.elastic import ElasticReplicas, ReplicaRestartLimit

    manager = SimpleNamespace(servers=[None, None], server_names=["replica 0 (rank 0)", "replica 1 (rank 1)"])
    elastic = ElasticReplicas(manager, max_restarts=0)
    with pytest.raises(ReplicaRestartLimit) as raised:
        elastic.replica_died(1, "worker group 'hybridflow_rollout' rank 1 (pid 42) died")
    message = str(raised.value)
    assert message.startswith("replica 1 (rank 1) of the rollout pool died (worker group"), message
    assert "have died 1 times in this run" in message, message
    assert "actor_rollout_ref.rollout.max_replica_restarts=0" in message, message


def test_the_limit_is_fully_async_s_key_and_main_ppo_refuses_other_values():
    """``max_replica_restarts`` acts in fully_async_main (checked >= 0); in main_ppo a replica is a
    training rank, so a value other than the default is refused, saying why (honest config)."""
    from omegaconf import OmegaConf

    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.config.honesty import honesty_problems
    from hybridflow.trainer.fully_async.main import fully_async_problems

    key = "actor_rollout_ref.rollout.max_replica_restarts"
    main_ppo = load_config([f"{key}=5"])
    OmegaConf.resolve(main_ppo)
    (refused,) = [p for p in honesty_problems(main_ppo) if key in p]
    assert "fully_async_main's key" in refused and "training rank" in refused, refused
    for value, problems in (("5", []), ("-1", [f"{key} must be an integer >= 0, got -1"])):
        config = load_config([f"{key}={value}"], config_name="fully_async_ppo_trainer")
        OmegaConf.resolve(config)
        assert [p for p in fully_async_problems(config) if key in p] == problems


@pytest.fixture(scope="module")
def elastic_pool(ray_session):
    """``(manager, trainer, watched)``: two replicas serving, synced to the trainer's weights (version
    1), watched by the manager's watcher on a thread (:class:`Watched`)."""
    import ray

    from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from hybridflow.single_controller.ray.base import wait_futures
    from hybridflow.workers.checkpoint_engine import CheckpointEngineManager
    from hybridflow.workers.rollout.agent_loop.elastic import ElasticReplicas
    from tests.workers.rollout.elastic_workers import LoopClient, PlainTrainer, ScriptedReplica, bare_manager

    trainer = RayWorkerGroup(
        RayResourcePool([1], name_prefix="el_trainer"), RayClassWithInitArgs(PlainTrainer), name_prefix="el_t"
    )
    replicas = RayWorkerGroup(
        RayResourcePool([2], name_prefix="el_rollout"),
        RayClassWithInitArgs(ScriptedReplica, seed=1),
        name_prefix="el_rollout",
    )
    wait_futures([trainer.init_model_async(), replicas.init_model_async()])
    manager = bare_manager(replicas, LoopClient)
    manager.elastic = ElasticReplicas(manager, max_restarts=3)
    sync = CheckpointEngineManager("gloo", trainer, replicas, 4 * KIB, "torch.float32")
    manager.elastic.weight_sync = sync
    trainer.perturb(1)
    sync.update_weights(1)
    watch = Watched(manager)
    yield manager, trainer, watch
    try:
        watch.stop()
    except Exception:  # noqa: S110  (a replica the last test killed for good)
        pass
    for server in manager.servers:
        server.fail.remote("test over")
    for actor in [*manager.servers, *manager.workers]:
        ray.kill(actor)
    replicas.shutdown()
    trainer.shutdown()


class Watched:
    """The replicas serving, watched by the manager's watcher on a thread (its error kept)."""

    def __init__(self, manager) -> None:
        self.manager, self.errors, self.ended = manager, [], threading.Event()
        _, self.refs = manager.start_serving()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        try:
            self.manager.watch_serving(self.refs, self.ended.is_set)
        except BaseException as error:  # the test reads it
            self.errors.append(error)

    def stop(self) -> None:
        """Serving ends (a replica's worker takes other calls only then: a serve loop is one call)."""
        self.ended.set()
        self.thread.join(timeout=10)
        self.manager.stop_serving(self.refs)


def _kill(manager, replica: int) -> int:
    pid = manager.worker_group.worker_pids[replica]
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow  # make test-slow: four Ray processes with torch start in 20-60 s on 2 cores
def test_a_killed_replica_s_requests_go_to_the_other_and_a_new_one_joins_with_the_trainers_weights(
    elastic_pool,
):
    import ray

    manager, trainer, watch = elastic_pool
    client, elastic = manager.workers[0], manager.elastic
    # 8 requests of 40 tokens (2 s each), spread over the two replicas
    refs = [client.generate.remote(f"r{i}", 40) for i in range(8)]
    _wait_until(lambda: ray.get(manager.servers[1].in_flight.remote()) >= 4, what="replica 1 busy")
    time.sleep(0.3)  # its engine is generating them
    old_pid = _kill(manager, 1)
    _wait_until(lambda: elastic.pending, what="the restart")
    assert elastic.restarts == 1
    outputs = ray.get(refs, timeout=60)
    assert all(len(o.token_ids) == 40 and o.stop_reason == "length" for o in outputs)
    assert all(o.weight_version == 1 for o in outputs)  # replica 0 finished them, with the synced weights
    assert ray.get(client.requests_rerouted.remote()) >= 4

    # the trainer (idle, its weights still version 1) loads the new replica, which serves again
    elastic.load_pending(1)
    assert not elastic.pending and manager.serving_refs[1] is not None
    assert manager.worker_group.worker_pids[1] != old_pid
    sent_before = ray.get(client.sent.remote())
    more = ray.get([client.generate.remote(f"s{i}", 4) for i in range(6)], timeout=60)
    sent_after = ray.get(client.sent.remote())
    assert sent_after[1] - sent_before[1] >= 3, (
        sent_before,
        sent_after,
    )  # the least in flight: it catches up
    assert all(o.weight_version == 1 and len(o.token_ids) == 4 for o in more)
    assert not watch.errors, watch.errors
    watch.stop()
    got, expected = manager.worker_group.view([1]).weights()[0], trainer.full_weights()[0]
    assert sorted(got) == sorted(expected)
    assert all((got[name] == expected[name]).all() for name in expected), "the new replica's weights differ"


@pytest.mark.slow  # make test-slow: the pool above
def test_a_replica_killed_between_serving_phases_is_replaced_at_the_wake_up_and_loaded_by_the_sync(
    elastic_pool,
):
    """Killed while the pool sleeps (the rollouter paused: no serve loop is watched), a replica is found
    dead by the next phase's wake-up, replaced there, and the other one serves alone; the next parameter
    sync of the whole pool gives the new process the weights and it serves from the phase after."""
    import ray

    manager, trainer, watch = elastic_pool
    client, elastic = manager.workers[0], manager.elastic
    if not watch.ended.is_set():
        watch.stop()  # the pool sleeps, as during a parameter sync
    restarts = elastic.restarts
    old_pid = _kill(manager, 0)
    watch.__init__(manager)  # the wake-up of the next phase meets the dead process
    assert elastic.restarts == restarts + 1 and 0 in elastic.pending
    assert manager.serving_refs[0] is None and manager.serving_refs[1] is not None
    outputs = ray.get([client.generate.remote(f"p{i}", 4) for i in range(4)], timeout=60)
    assert all(len(o.token_ids) == 4 for o in outputs)  # replica 1 alone served them

    # a pause and a parameter sync, as fully_async's trainer does them: the new process is loaded too
    watch.stop()
    trainer.perturb(2)
    elastic.weight_sync.update_weights(2)
    elastic.weights_loaded()
    watch.__init__(manager)
    assert manager.serving_refs[0] is not None and manager.worker_group.worker_pids[0] != old_pid
    sent_before = ray.get(client.sent.remote())
    more = ray.get([client.generate.remote(f"q{i}", 4) for i in range(6)], timeout=60)
    assert ray.get(client.sent.remote())[0] > sent_before[0], "the new replica took no request"
    assert all(o.weight_version == 2 for o in more)
    assert not watch.errors, watch.errors
    watch.stop()
    got, expected = manager.worker_group.view([0]).weights()[0], trainer.full_weights()[0]
    assert all((got[name] == expected[name]).all() for name in expected), "the new replica's weights differ"


@pytest.mark.slow  # make test-slow: the pool above
def test_replicas_that_keep_dying_end_the_run_naming_the_replica_and_the_count(elastic_pool):
    from hybridflow.workers.rollout.agent_loop.elastic import ReplicaRestartLimit

    manager, _, watch = elastic_pool
    if watch.ended.is_set():  # serving again, watched
        watch.__init__(manager)  # the fixture's teardown stops this one
    manager.elastic.max_restarts = manager.elastic.restarts  # no restart left
    restarts = manager.elastic.restarts
    _kill(manager, 0)
    _wait_until(lambda: watch.errors, what="the watcher's error")
    watch.ended.set()
    (error,) = watch.errors
    assert isinstance(error, ReplicaRestartLimit), repr(error)
    message = str(error)
    assert "replica 0 (rank 0) of the rollout pool died" in message, message
    assert f"died {restarts + 1} times" in message, message
    assert "actor_rollout_ref.rollout.max_replica_restarts" in message, message
