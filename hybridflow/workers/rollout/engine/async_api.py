"""The engine's asynchronous API: many concurrent callers share one running batch.

``await engine.generate(prompt_ids, params)`` queues one request and returns its result; many
concurrent calls (multi-turn conversations, an OpenAI server's requests) share the running batch, which
an event-loop task steps while anything is pending. With ``step_in_thread`` (the OpenAI server) each
step runs in the engine's own thread, so the event loop keeps answering while a long prefill runs.
A caller that gives up (a client disconnected) aborts its request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from hybridflow.workers.rollout.engine.requests import (
    EngineRequest,
    EngineRequestError,
    GenerationResult,
    settle,
)
from hybridflow.workers.rollout.engine.sampling import SamplingParams


class AsyncEngineAPI:
    """Mixed into :class:`~.llm_engine.LLMEngine` (which provides ``add_request``, ``abort``, ``step``,
    ``has_unfinished`` and the scheduler's queues)."""

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        request_id: str | None = None,
        images: dict | None = None,
    ) -> GenerationResult:
        """Generate for one prompt, sharing the running batch with every other pending call
        (``images``: as :meth:`add_request`'s; a later turn of a conversation passes its first turn's)."""
        request = self.add_request(prompt_ids, params, n, request_id, images=images)
        request.future = asyncio.get_running_loop().create_future()
        self._ensure_loop()
        try:
            return await request.future
        except asyncio.CancelledError:  # the caller gave up (a client disconnected): free its slots
            self.abort(request.request_id)
            raise

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ):
        """Like :meth:`generate`, as an async iterator: ``(sample, token id, log-prob)`` for each token
        as it is chosen, then the :class:`GenerationResult`."""
        request = self.add_request(prompt_ids, params, n, request_id)
        request.listener = asyncio.Queue()
        self._ensure_loop()
        ended = False
        try:
            while True:
                event = await request.listener.get()
                if isinstance(event, BaseException):
                    ended = True
                    raise event
                if isinstance(event, GenerationResult):
                    ended = True
                    if event.error is not None:
                        raise EngineRequestError(event.error)
                    yield event
                    return
                yield event
        finally:
            if not ended:  # the consumer stopped reading (a client disconnected): free its slots
                self.abort(request.request_id)

    async def score(self, sequences: list[list[int]], starts: list[int], k: int, temperature: float = 1.0):
        """Top-``k`` log-probs at ``starts[i]:`` of each sequence, generating nothing (:mod:`.scoring`)."""
        from hybridflow.workers.rollout.engine.scoring import score_in_engine

        return await score_in_engine(self, sequences, starts, k, temperature)

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop_task is None or self._loop_task.done():
            self._event_loop = loop
            self._loop_task = loop.create_task(self._run_loop())

    async def _run_loop(self) -> None:
        """Step while anything is pending, yielding to the event loop between steps (with
        ``step_in_thread``, awaiting each step run in the engine's thread)."""
        try:
            while self.has_unfinished():
                if self.step_in_thread:
                    if self._executor is None:
                        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
                    self._stepping_in_thread = True
                    try:
                        await asyncio.get_running_loop().run_in_executor(self._executor, self._thread_step)
                    finally:
                        self._stepping_in_thread = False
                else:
                    self.step()
                await asyncio.sleep(0)
        except Exception as error:  # a failure no single request explains: every waiter learns it
            pending = self._drop_everything()
            for request in {id(r): r for r in pending}.values():
                if request.future is not None and not request.future.done():
                    request.future.set_exception(error)
                if request.listener is not None:
                    request.listener.put_nowait(error)
            raise

    def _thread_step(self) -> None:
        self._step_thread = threading.current_thread()
        self.step()

    def _to_loop(self, callback, *args) -> None:
        """Run ``callback(*args)`` on the event loop: now, or from the step thread via the loop."""
        if self._stepping_in_thread and self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(callback, *args)
        else:
            callback(*args)

    def _deliver(self, request: EngineRequest, result: GenerationResult) -> None:
        """Hand a finished request's result to whoever awaits it (``generate`` / ``stream``)."""
        if request.future is not None:
            self._to_loop(settle, request.future, result)
        if request.listener is not None:
            self._to_loop(request.listener.put_nowait, result)
