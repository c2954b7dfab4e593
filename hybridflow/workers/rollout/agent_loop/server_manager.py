"""The agent loops' view of the generation servers (verl's ``AsyncLLMServerManager``).

- **Sticky sessions**: every call with the same ``request_id`` (one sample's turns) goes to the same
  replica, whose prefix cache (vLLM) or KV (the next turn's prompt is the last turn's) it can reuse;
  the map is an LRU of ``max_cache_size`` ids.
- **Least in flight**: a new ``request_id`` goes to the replica with the fewest requests in flight
  from this manager (ties: the fewest sent so far), so a replica that drew long samples gets no more
  until it catches up — the balance a static split across ranks cannot give.
- **No hang**: a call that takes longer than ``rollout.agent.generate_timeout_s`` raises
  :class:`~hybridflow.workers.rollout.replica.ReplicaError` naming the replica and the request.
- **Elastic replicas** (fully async): a call whose replica died (its server raises
  :class:`~hybridflow.workers.rollout.replica.ReplicaLost`) is sent again to another replica, from the
  same prompt (the tokens of that turn died with the engine; a multi-turn sample keeps its earlier
  turns, which are in the prompt), and counted in :attr:`AsyncLLMServerManager.rerouted`. The replica
  is skipped until the driver says it is back (:meth:`AsyncLLMServerManager.replica_up`); while no
  replica is up, requests wait at a lost one's server for its new engine.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from typing import Any

from hybridflow.utils.rollout_trace import rollout_trace_op
from hybridflow.workers.rollout.agent_loop.images import image_inputs, is_processed
from hybridflow.workers.rollout.replica import ReplicaError, ReplicaLost, TokenOutput


class AsyncLLMServerManager:
    """``server_handles``: the replicas' :class:`~hybridflow.workers.rollout.replica.LLMServer` actor
    handles; ``names``: how messages name them."""

    def __init__(
        self,
        config,
        server_handles: list,
        max_cache_size: int = 10000,
        names: list[str] | None = None,
        timeout_s: float | None = None,
        processor=None,
    ) -> None:
        if not server_handles:
            raise ValueError("AsyncLLMServerManager needs at least one server")
        self.config = config
        self.server_handles = list(server_handles)
        self.names = list(names or [f"replica {i}" for i in range(len(server_handles))])
        self.timeout_s = timeout_s
        self.processor = processor  # the model's image processor (PIL image_data); None: text-only
        self.in_flight = [0] * len(server_handles)
        self.sent = [0] * len(server_handles)
        self.max_cache_size = int(max_cache_size)
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._calls: dict[str, tuple[int, str]] = {}  # request_id -> (replica, call id) in flight
        self.down: set[int] = set()  # replicas whose engine died, until replica_up
        self.rerouted = 0  # calls sent again to another replica because theirs died

    def replica_down(self, index: int) -> None:
        """Send nothing more to replica ``index`` (its engine died) until :meth:`replica_up`."""
        self.down.add(int(index))

    def replica_up(self, index: int) -> None:
        """Replica ``index`` serves again (a new engine with the current weights)."""
        self.down.discard(int(index))

    def _choose_server(self, request_id: str) -> int:
        sticky = self._sticky.get(request_id)
        if sticky is not None and sticky not in self.down:
            self._sticky.move_to_end(request_id)
            return sticky
        up = [i for i in range(len(self.server_handles)) if i not in self.down]
        index = min(up or range(len(self.server_handles)), key=lambda i: (self.in_flight[i], self.sent[i], i))
        self._sticky[request_id] = index
        self._sticky.move_to_end(request_id)
        if len(self._sticky) > self.max_cache_size:
            self._sticky.popitem(last=False)
        return index

    @rollout_trace_op
    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data=None,
        video_data=None,
    ) -> TokenOutput:
        """Generate from ``prompt_ids`` on the replica this ``request_id`` sticks to. ``image_data``: a
        vision-language sample's ``multi_modal_inputs`` (:meth:`~.replica.LLMServer.generate`), or verl's
        list of PIL images (or image dicts), processed here with the model's image processor
        (:mod:`.images`)."""
        if image_data is not None and not is_processed(image_data):
            image_data = (
                await asyncio.to_thread(
                    image_inputs, self.processor, image_data, list(prompt_ids), request_id
                )
                or None
            )
        inputs = (prompt_ids, sampling_params, image_data, video_data)
        while True:
            index = self._choose_server(request_id)
            try:
                return await self._call(index, request_id, *inputs)
            except ReplicaLost:  # its engine died (the turn's tokens with it): another replica, same prompt
                self.down.add(index)
                self.rerouted += 1

    async def _call(self, index, request_id, prompt_ids, sampling_params, image_data, video_data):
        """One call of ``request_id`` on replica ``index`` (waiting for a lost one's new engine when no
        replica is up)."""
        self.in_flight[index] += 1
        self.sent[index] += 1
        call_id = uuid.uuid4().hex  # one id per turn on the server (a sample's turns share request_id)
        handle = self.server_handles[index]
        try:
            pending = handle.generate.remote(
                call_id,
                prompt_ids=list(prompt_ids),
                sampling_params=dict(sampling_params),
                image_data=image_data,
                video_data=video_data,
                wait_if_lost=len(self.down) >= len(self.server_handles),
            )
            self._calls[request_id] = (index, call_id)
            return await asyncio.wait_for(_awaitable(pending), self.timeout_s)
        except TimeoutError:
            handle.abort.remote(call_id)
            raise ReplicaError(
                f"{self.names[index]}: request {request_id} got no answer within "
                f"rollout.agent.generate_timeout_s={self.timeout_s:g}s"
            ) from None
        finally:
            self.in_flight[index] -= 1
            self._calls.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id``'s call in flight: it returns its tokens so far (``stop_reason="aborted"``)."""
        call = self._calls.get(request_id)
        if call is not None:
            index, call_id = call
            await _awaitable(self.server_handles[index].abort.remote(call_id))

    def load(self) -> dict[str, float]:
        """Requests sent per replica (the balance the manager achieved)."""
        return {name: float(count) for name, count in zip(self.names, self.sent, strict=True)}


def _awaitable(ref):
    """A Ray ObjectRef as an awaitable (Ray refs are awaitable inside an event loop)."""

    async def wait():
        return await ref

    return wait()
