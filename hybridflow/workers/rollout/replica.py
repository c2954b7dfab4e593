"""Generation server replicas (verl's rollout replicas): requests one at a time, continuously batched.

A replica is one rollout engine (hybridflow's or vLLM) and its front door, :class:`LLMServer`, a small
async Ray actor. Agent loops call ``await server.generate.remote(request_id, prompt_ids=...,
sampling_params=...)`` and get a :class:`TokenOutput`; many calls are in flight at once. The engine
lives where its weights are — in hybrid mode inside the actor's worker process (it shares the actor's
weights and their in-place sync), in standalone mode in a rollout process of its own — and runs
:func:`serve_requests` there: one exchange with its server per engine step hands over the requests that
arrived and the ones that finished, so the engine's running batch always holds every request in flight.
The worker process stays a plain sequential Ray actor (its collectives keep their order); only the
server is asynchronous.

Aborts (partial rollout): ``abort(request_id)`` / ``abort_all()`` end requests mid-flight; each returns
the tokens and log-probs generated so far with ``stop_reason="aborted"``. A replica whose engine process
dies is failed by its manager (:meth:`LLMServer.fail`): every waiting request raises
:class:`ReplicaError` naming the replica, none hangs. With elastic replicas (fully async) the manager
marks it lost instead (:meth:`LLMServer.lose`): the waiting requests raise :class:`ReplicaLost`, which the
agent loops' server manager answers by sending them to another replica, and the server takes requests
again once a new engine serves it (:meth:`LLMServer.recover`).

Router replay R3: an engine that records routing (``rollout.enable_rollout_routing_replay``) hands each
request's expert ids (prompt + generated tokens, :mod:`.engine.routing`) back in
``TokenOutput.routed_experts``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

# sampling_params keys a request may carry (verl's names; max_tokens also as max_new_tokens)
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "do_sample",
    "seed",
    "seed_sample",
    "seed_position",
    "logprobs",
    "repetition_penalty",
)


class TokenOutput(BaseModel):
    """One request's generated tokens (verl's ``TokenOutput``)."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    stop_reason: str | None = None  # "completed" (stop token), "length", "aborted"
    num_preempted: int | None = None
    weight_version: int | None = None  # the replica's weights when the request finished
    # router replay R3 (engine/routing.py): (prompt + generated tokens, L sparse layers, k) expert ids,
    # a torch tensor of small ints, when the engine records routing (else None)
    routed_experts: Any | None = None


class ReplicaError(RuntimeError):
    """A replica could not serve a request (its engine process died, or it refused the request)."""


class ReplicaLost(ReplicaError):
    """The replica's engine process died and a new one is starting: send the request elsewhere (what it
    had generated died with the engine)."""


STOP_REASONS = {"stop": "completed", "length": "length", "abort": "aborted"}


class LLMServer:
    """The front door of one replica (a Ray actor with ``num_cpus=0``: it only waits). ``name`` says
    which replica it is in messages ("replica 1 (rank 1)")."""

    def __init__(self, name: str) -> None:
        self.name = name
        # (request id, prompt ids, sampling_params, images or None)
        self._queue: deque[tuple[str, list[int], dict, dict | None]] = deque()
        self._futures: dict[str, asyncio.Future] = {}
        self._no_log_probs: set[str] = set()  # requests that asked for none (logprobs=false)
        self._aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._stop = False
        self._failed: str | None = None
        self._lost: str | None = None  # the engine died, a new one is starting (elastic replicas)
        self._aborting = False  # after abort_all, until start_serving: new requests end at once
        self.served = 0

    # ------------------------------------------------------------------ clients (agent loops)
    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        image_data=None,
        video_data=None,
        wait_if_lost: bool = False,
    ) -> TokenOutput:
        """Generate for ``prompt_ids``; returns when the request finishes or is aborted. ``image_data``:
        a vision-language prompt's processed images, the sample's ``multi_modal_inputs``
        (``pixel_values``, ``image_grid_thw``), for the prompt's ``<|image_pad|>`` tokens (hybridflow's
        engine; every turn of a conversation passes its first turn's). While the replica is lost
        (:meth:`lose`) this raises :class:`ReplicaLost`, or with ``wait_if_lost`` (no replica is up) waits
        for the new engine."""
        if video_data is not None:
            raise ReplicaError(f"{self.name}: video inputs are not supported")
        if image_data is not None and not (isinstance(image_data, dict) and "image_grid_thw" in image_data):
            raise ReplicaError(
                f"{self.name}: request {request_id}: image_data must be the sample's multi_modal_inputs "
                f"(pixel_values, image_grid_thw), not {type(image_data).__name__}: the engine takes the "
                "processor's output, not PIL images"
            )
        if self._failed is not None:
            raise ReplicaError(self._failed)
        if self._lost is not None and not wait_if_lost:
            raise ReplicaLost(self._lost)
        if self._aborting:  # a partial-rollout pause: the sample stops where it stands
            return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted")
        if request_id in self._futures:
            raise ReplicaError(f"{self.name}: request id {request_id!r} is already in flight")
        unknown = sorted(set(sampling_params or {}) - set(SAMPLING_KEYS))
        if unknown:
            raise ReplicaError(
                f"{self.name}: unknown sampling_params {unknown}; known: {list(SAMPLING_KEYS)}"
            )
        future = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        if not (sampling_params or {}).get("logprobs", True):  # rollout.calculate_log_probs=false
            self._no_log_probs.add(request_id)
        self._queue.append(
            (request_id, [int(t) for t in prompt_ids], dict(sampling_params or {}), image_data or None)
        )
        self._wake.set()
        try:
            return await future
        finally:
            self._futures.pop(request_id, None)
            self._no_log_probs.discard(request_id)

    async def abort(self, request_id: str) -> None:
        """End ``request_id``: it returns what it generated so far (``stop_reason="aborted"``)."""
        if self._drop_queued(request_id):
            return
        if request_id in self._futures:
            self._aborts.add(request_id)
            self._wake.set()

    async def abort_all(self) -> int:
        """Abort every request in flight (partial rollout), and end any that arrives until the next
        :meth:`start_serving` (a multi-turn sample between turns stops too); returns how many were in
        flight."""
        self._aborting = True
        count = len(self._futures)
        for request_id in list(self._futures):
            await self.abort(request_id)
        return count

    def in_flight(self) -> int:
        return len(self._futures)

    # ------------------------------------------------------------------ the engine side
    async def exchange(
        self, finished: list[dict], idle: bool = False, wait_s: float = 0.5, hold: bool = False
    ) -> dict:
        """Called by :func:`serve_requests`: ``finished`` outputs in, the new requests, the aborts and
        whether to stop out. When the engine is ``idle``, or asks to ``hold`` (it keeps stepping while
        this call is in flight), this waits up to ``wait_s`` for news: a request, an abort or a stop."""
        self.deliver(finished)
        if (idle or hold) and not (self._queue or self._aborts or self._stop):
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait_s)
            except TimeoutError:
                pass
        new = list(self._queue)
        self._queue.clear()
        aborts = sorted(self._aborts)
        self._aborts.clear()
        return {"new": new, "abort": aborts, "stop": self._stop}

    def deliver(self, finished: list[dict]) -> None:
        """Finished outputs from the engine, sent while an exchange is held: each request returns."""
        for output in finished:
            self._resolve(output)

    def _resolve(self, output: dict) -> None:
        future = self._futures.get(output["request_id"])
        if future is None or future.done():
            return
        if output.get("error"):
            future.set_exception(ReplicaError(f"{self.name}: {output['error']}"))
            return
        self.served += 1
        future.set_result(
            TokenOutput(
                token_ids=output["token_ids"],
                log_probs=None if output["request_id"] in self._no_log_probs else output["log_probs"],
                stop_reason=STOP_REASONS.get(output["finish_reason"], output["finish_reason"]),
                weight_version=output.get("weight_version"),
                routed_experts=output.get("routed_experts"),
            )
        )

    def _drop_queued(self, request_id: str) -> bool:
        for entry in self._queue:
            if entry[0] == request_id:
                self._queue.remove(entry)
                future = self._futures.get(request_id)
                if future is not None and not future.done():
                    future.set_result(TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted"))
                return True
        return False

    async def start_serving(self) -> None:
        """Accept requests again after :meth:`stop_serving` (a new rollout phase)."""
        self._stop = False
        self._aborting = False

    async def stop_serving(self) -> None:
        """Let the engine's serve loop return once it holds no request."""
        self._stop = True
        self._wake.set()

    async def fail(self, reason: str) -> None:
        """The engine behind this server is gone: every waiting request raises, new ones too."""
        self._failed = f"{self.name}: {reason}"
        for future in self._futures.values():
            if not future.done():
                future.set_exception(ReplicaError(self._failed))
        self._queue.clear()

    async def lose(self, reason: str) -> int:
        """The engine behind this server died and a new one is starting (elastic replicas): every request
        waiting here raises :class:`ReplicaLost` (its client sends it to another replica), and so do new
        ones until :meth:`recover`, except those that ask to wait. Returns how many were waiting."""
        self._lost = f"{self.name}: {reason}"
        waiting = [f for f in self._futures.values() if not f.done()]
        for future in waiting:
            future.set_exception(ReplicaLost(self._lost))
        self._queue.clear()
        self._aborts.clear()
        return len(waiting)

    def lost(self) -> bool:
        return self._lost is not None

    async def recover(self) -> None:
        """Clear a failure or a loss (the engine behind was replaced)."""
        self._failed = None
        self._lost = None


@dataclass
class ServeStats:
    """What one serve loop did (returned to the manager for metrics)."""

    requests: int = 0
    aborted: int = 0
    steps: int = 0
    exchanges: int = 0
    deliveries: int = 0  # one-way calls with finished outputs while an exchange was held
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    # hybridflow's engine (its block pool), over this loop: prompt tokens looked up in the prefix cache
    # and found there, sequences preempted, and the most KV blocks held at once over the pool's
    # (None: an engine without a block pool, vLLM's)
    prefix_queries: int | None = None
    prefix_hits: int | None = None
    preemptions: int | None = None
    kv_blocks_peak_frac: float | None = None


def _cache_counts(engine) -> tuple[int, int, int] | None:
    """(prefix-cache queries, hits, preemptions) so far of hybridflow's engine, its pool's peak block
    count restarted from what it holds now; None for an engine without a block pool."""
    pool = getattr(engine, "pool", None)
    if pool is None:
        return None
    pool.stats["peak_blocks"] = pool.num_used
    return pool.stats["prefix_queries"], pool.stats["prefix_hits"], engine.stats["preemptions"]


def _record_cache(stats: ServeStats, engine, before: tuple[int, int, int] | None) -> None:
    if before is None:
        return
    pool = engine.pool
    stats.prefix_queries = pool.stats["prefix_queries"] - before[0]
    stats.prefix_hits = pool.stats["prefix_hits"] - before[1]
    stats.preemptions = engine.stats["preemptions"] - before[2]
    stats.kv_blocks_peak_frac = pool.stats["peak_blocks"] / max(1, pool.num_blocks)


EXCHANGE_INTERVAL_S = 0.01  # after a stop, while requests still run: at most one exchange per this


def serve_requests(
    engine,
    server,
    defaults,
    weight_version: int = 0,
    wait_s: float = 0.5,
    exchange_interval_s: float = EXCHANGE_INTERVAL_S,
) -> dict:
    """Serve ``server``'s requests with ``engine`` until it says stop and nothing is in flight.

    One exchange with the server (a Ray round trip) is always in flight, and the server holds it until
    it has news for the engine (new requests, aborts, stop) or ``wait_s`` passes; the engine keeps
    stepping meanwhile and takes the reply at the first step after it arrives, so neither a round trip
    nor a quiet server ever stalls decoding. Outputs that finish while the exchange is held go to the
    server at once in a one-way :meth:`LLMServer.deliver` call. So the Ray calls follow the requests,
    not the steps: before, an exchange every ~10 ms of stepping (a tiny model's step takes a few) was a
    round trip on the cores the engines decode on; holding it took a 200-step burst of 16 requests from
    ~120 exchanges to ~40 and the long-tail workload's server mode from 0.98x to 1.10x sync
    (``benchmarks/long_tail.py``, 2 cores). After a stop with requests still running, exchanges come
    at most every ``exchange_interval_s`` (the server answers those at once).

    ``engine``: :class:`~hybridflow.workers.rollout.engine.LLMEngine` or
    :class:`~hybridflow.workers.rollout.vllm_rollout.engine.VLLMEngine` (``add_request``, ``step``,
    ``abort``, ``has_unfinished``); ``defaults``: the rollout's
    :class:`~hybridflow.workers.rollout.engine.SamplingParams` (stop tokens, response length), which a
    request's ``sampling_params`` override. Returns :class:`ServeStats` as a dict."""
    import dataclasses

    import ray

    stats, start = ServeStats(), time.perf_counter()
    cache_before = _cache_counts(engine)
    finished: list[dict] = []  # outputs not yet sent
    in_flight = None  # the exchange sent and not yet answered (at most one)
    last_exchange, stopping = float("-inf"), False

    def send():
        nonlocal finished, last_exchange
        ref = server.exchange.remote(finished, wait_s=wait_s, hold=True)  # held until news, busy or not
        finished, last_exchange = [], time.perf_counter()
        stats.exchanges += 1
        return ref

    def deliver() -> None:  # the exchange in flight is held: finished outputs go one way, now
        nonlocal finished
        server.deliver.remote(finished)
        finished = []
        stats.deliveries += 1

    def take(reply: dict) -> None:
        for request_id, prompt_ids, sampling, images in reply["new"]:
            try:
                params = request_params(defaults, sampling, len(prompt_ids), engine.max_model_len)
                if images:  # a vision-language prompt (hybridflow's engine)
                    engine.add_request(prompt_ids, params, 1, request_id, images=images)
                else:
                    engine.add_request(prompt_ids, params, 1, request_id)
                stats.requests += 1
            except ValueError as error:  # a bad request fails alone; the replica keeps serving
                finished.append({"request_id": request_id, "error": str(error)})
                stats.errors.append(str(error))
        for request_id in reply["abort"]:
            result = engine.abort(request_id)
            if result is not None:
                stats.aborted += 1
                finished.append(_output(result, weight_version))

    while True:
        if engine.has_unfinished():
            if in_flight is not None and ray.wait([in_flight], timeout=0)[0]:
                reply = ray.get(in_flight)
                in_flight, stopping = None, reply["stop"]
                take(reply)
            if in_flight is None and (
                not stopping or time.perf_counter() - last_exchange >= exchange_interval_s
            ):
                in_flight = send()
            finished.extend(_output(result, weight_version) for result in engine.step())
            stats.steps += 1
            if finished and in_flight is not None:
                deliver()
            continue
        # nothing to step: the reply decides what comes next (new work, or stop)
        if in_flight is None:
            in_flight = send()
        elif finished:
            deliver()
        reply = ray.get(in_flight)
        in_flight, stopping = None, reply["stop"]
        take(reply)  # outputs it made (errors, aborts) go with the next exchange, sent at once when idle
        if reply["stop"] and not engine.has_unfinished() and not finished:
            break
    stats.seconds = time.perf_counter() - start
    _record_cache(stats, engine, cache_before)
    return dataclasses.asdict(stats)


def request_params(defaults, sampling: dict, prompt_len: int, max_model_len: int):
    """A request's :class:`SamplingParams`: the rollout's ``defaults`` overridden by verl-style
    ``sampling`` keys. ``max_tokens`` defaults to the rollout's response length, capped by the room
    left in ``max_model_len``; ``logprobs`` is the server's business (the engines always compute them;
    :class:`LLMServer` drops them from the answer when a request sets ``logprobs`` false)."""
    from dataclasses import replace

    if float(sampling.get("repetition_penalty", 1.0)) != 1.0:
        raise ValueError(
            "repetition_penalty other than 1.0 is not supported (it changes the sampled distribution)"
        )
    changes: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        if sampling.get(key) is not None:
            changes[key] = float(sampling[key])
    if sampling.get("top_k") is not None:
        changes["top_k"] = int(sampling["top_k"])
    for key in ("do_sample", "ignore_eos"):
        if sampling.get(key) is not None:
            changes[key] = bool(sampling[key])
    if sampling.get("stop_token_ids") is not None:
        changes["stop_token_ids"] = tuple(int(t) for t in sampling["stop_token_ids"])
    if sampling.get("seed") is not None:
        changes["seed"] = int(sampling["seed"])
        changes["seed_sample"] = int(sampling.get("seed_sample") or 0)
        changes["seed_position"] = int(sampling.get("seed_position") or 0)
    max_tokens = sampling.get("max_tokens", sampling.get("max_new_tokens"))
    budget = max_model_len - prompt_len
    if budget < 1:
        raise ValueError(
            f"prompt of {prompt_len} tokens leaves no room to generate within max_model_len={max_model_len}"
        )
    wanted = int(max_tokens) if max_tokens is not None else defaults.max_new_tokens
    if wanted < 1:
        raise ValueError(f"max_tokens must be >= 1, got {wanted}")
    changes["max_new_tokens"] = min(wanted, budget)
    return replace(defaults, **changes)


def _output(result, weight_version: int) -> dict:
    if getattr(result, "error", None) is not None:  # failed inside the engine: this request alone
        return {"request_id": result.request_id, "error": result.error}
    completion = result.completions[0]
    return {
        "request_id": result.request_id,
        "token_ids": list(completion.token_ids),
        "log_probs": [float(x) for x in completion.log_probs],
        "finish_reason": completion.finish_reason,
        "weight_version": weight_version,
        # router replay R3: the request's prompt + generated tokens' expert ids (engine recording them)
        "routed_experts": getattr(completion, "routed_experts", None),
    }
