"""Light worker classes for the elastic-replica tests (:mod:`tests.workers.rollout.test_elastic_replicas`):
a trainer holding a small plain torch model, rollout replicas holding a copy and serving requests with a
slow scripted engine (one token per step, so a kill lands mid-rollout), and an agent-loop client that
routes requests through the real :class:`~hybridflow.workers.rollout.agent_loop.AsyncLLMServerManager`.
Real Ray processes, the real checkpoint engine (gloo), the real servers and serve loop: only the model
and the engine are small, so the processes start in a few seconds."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.checkpoint_engine.manager import CheckpointEngineWorker


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _numpy(module: torch.nn.Module) -> dict:
    return {name: p.detach().clone().numpy() for name, p in module.named_parameters()}


class PlainTrainer(CheckpointEngineWorker, Worker):
    """The actor's side: one rank, a plain model (the stream of its weights is the actor's)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        torch.set_num_threads(1)
        self.actor_module = small_model(self.seed)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def perturb(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.actor_module.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.01)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_weights(self) -> dict:
        return _numpy(self.actor_module)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights_by_checkpoint_engine(self) -> tuple:
        from hybridflow.workers.checkpoint_engine import measured_sync, trainer_weight_stream

        engine = self.checkpoint_engine
        payload, stats = measured_sync(lambda: engine.send_weights(trainer_weight_stream(self.actor_module)))
        return payload, {**engine.stats, **stats}


class ScriptedEngine:
    """The engine interface :func:`~hybridflow.workers.rollout.replica.serve_requests` drives: every
    running request gets one token (its position) per step of ``step_s`` seconds."""

    max_model_len = 1024

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.running: dict[str, tuple[list[int], int]] = {}

    def add_request(self, prompt_ids, params, n, request_id) -> None:
        self.running[request_id] = ([], int(params.max_new_tokens))

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list:
        import time

        time.sleep(self.step_s)
        done = []
        for request_id, (tokens, wanted) in list(self.running.items()):
            tokens.append(len(tokens))
            if len(tokens) >= wanted:
                done.append(self._result(request_id, "length"))
        return done

    def abort(self, request_id: str):
        return self._result(request_id, "abort") if request_id in self.running else None

    def _result(self, request_id: str, reason: str):
        tokens, _ = self.running.pop(request_id)
        completion = SimpleNamespace(token_ids=tokens, log_probs=[0.0] * len(tokens), finish_reason=reason)
        return SimpleNamespace(request_id=request_id, completions=[completion])


class ScriptedReplica(CheckpointEngineWorker, Worker):
    """A rollout replica (``StandaloneRolloutWorker``'s methods): a copy of the model, other weights
    (``seed``) until the checkpoint engine brings the trainer's, and the scripted engine."""

    def __init__(self, seed: int = 1, step_s: float = 0.05) -> None:
        super().__init__()
        self.seed, self.step_s = seed, step_s
        self.weight_version = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        torch.set_num_threads(1)
        self.module = small_model(self.seed)
        self.engine = ScriptedEngine(self.step_s)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict:
        return _numpy(self.module)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights_by_checkpoint_engine(self, version: int, payload=None) -> dict:
        from hybridflow.workers.checkpoint_engine import load_received, measured_sync

        received = self.checkpoint_engine.receive_weights(payload)
        loaded, stats = measured_sync(lambda: load_received(self.module, received))
        self.weight_version = int(version)
        return {**loaded, **stats, "engine_sync_s": 0.0}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_wake_up(self, rows: int | None = None) -> dict:
        return {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_sleep(self) -> None:
        return None

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def serve_requests(self, server) -> dict:
        from hybridflow.workers.rollout.engine.sampling import SamplingParams
        from hybridflow.workers.rollout.replica import serve_requests

        defaults = SamplingParams(max_new_tokens=8)
        return serve_requests(self.engine, server, defaults, weight_version=self.weight_version, wait_s=0.05)


class LoopClient:
    """An agent-loop worker's routing (:class:`~hybridflow.workers.rollout.agent_loop.worker.
    AgentLoopWorker`'s elastic methods) over the real server manager."""

    def __init__(self, server_handles: list, names: list[str]) -> None:
        from hybridflow.workers.rollout.agent_loop.server_manager import AsyncLLMServerManager

        self.server_manager = AsyncLLMServerManager(None, server_handles, names=names, timeout_s=60)

    async def generate(self, request_id: str, max_tokens: int):
        return await self.server_manager.generate(
            request_id, prompt_ids=[1, 2, 3], sampling_params={"max_tokens": max_tokens}
        )

    async def replica_down(self, index: int) -> None:
        self.server_manager.replica_down(index)

    async def replica_up(self, index: int) -> None:
        self.server_manager.replica_up(index)

    async def requests_rerouted(self) -> int:
        return self.server_manager.rerouted

    async def sent(self) -> list[int]:
        return list(self.server_manager.sent)


class WakeFailingReplica(ScriptedReplica):
    """A replica whose wake-up raises while ``fail_wake`` is set (a rank that cannot take the weights
    or allocate its cache)."""

    def __init__(self, seed: int = 1, step_s: float = 0.01) -> None:
        super().__init__(seed, step_s)
        self.fail_wake = True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_fail_wake(self, fail: bool) -> None:
        self.fail_wake = bool(fail)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_wake_up(self, rows: int | None = None) -> dict:
        if self.fail_wake:
            raise RuntimeError("the KV cache does not fit (scripted)")
        return {}


class ChunkClient(LoopClient):
    """An agent-loop worker's ``generate_sequences`` over the real server manager: one request per
    row, sent at once; each row's outcome (tokens or the error's type) kept for the test to read."""

    def __init__(self, server_handles: list, names: list[str]) -> None:
        super().__init__(server_handles, names)
        self.outcomes: list[str] = []

    async def generate_sequences(self, batch):
        import asyncio

        async def one(row: int):
            try:
                out = await self.generate(f"row-{row}-{len(self.outcomes)}", max_tokens=4)
                return f"{len(out.token_ids)} tokens"
            except Exception as error:  # Ray's RayTaskError(ReplicaError) is a ReplicaError too
                from hybridflow.workers.rollout.replica import ReplicaError

                return "ReplicaError" if isinstance(error, ReplicaError) else type(error).__name__

        self.outcomes = list(await asyncio.gather(*(one(row) for row in range(len(batch)))))
        if any("tokens" not in outcome for outcome in self.outcomes):
            raise RuntimeError(f"rows failed: {self.outcomes}")
        return batch

    async def last_outcomes(self) -> list[str]:
        return list(self.outcomes)


def bare_manager(replicas, client_cls):
    """An :class:`~hybridflow.workers.rollout.agent_loop.manager.AgentLoopManager`'s state without an
    agent-loop config: ``replicas`` (a worker group), one real :class:`LLMServer` per replica and one
    agent-loop client (``client_cls``, e.g. :class:`LoopClient`) as its only worker; not elastic."""
    import ray

    from hybridflow.workers.rollout.agent_loop.manager import AgentLoopManager
    from hybridflow.workers.rollout.replica import LLMServer

    manager = object.__new__(AgentLoopManager)
    manager.worker_group = replicas
    manager.server_names = [f"replica {r} (rank {r})" for r in range(replicas.world_size)]
    server_cls = ray.remote(num_cpus=0, max_concurrency=1000)(LLMServer)
    manager.servers = [server_cls.remote(name) for name in manager.server_names]
    client = ray.remote(num_cpus=0, max_concurrency=1000)(client_cls)
    manager.workers = [client.remote(manager.servers, manager.server_names)]
    manager.serving_refs, manager._down, manager.elastic = None, set(), None
    return manager

