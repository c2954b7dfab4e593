"""Sleep and wake a served engine (vLLM's ``/sleep`` / ``/wake_up`` / ``/is_sleeping``), as a colocated
reward model does between reward phases (:mod:`hybridflow.workers.reward_loop.servers`).

- ``POST /sleep`` (``?level=1``, the only level): new requests are refused with 503 + ``Retry-After``
  (the client retries, :mod:`hybridflow.utils.served_client`), the requests already admitted finish
  (at most ``SLEEP_WAIT_S``, else 409 and the server stays awake), then the engine's KV cache is
  released (:meth:`LLMEngine.release`) and the heap trimmed (:func:`trim_heap`). The weights stay: a
  judge is frozen, and on the CPU a re-read from disk would cost more than it frees. Answer:
  ``{"sleeping": true, "freed_kv_bytes", "rss_before_bytes", "rss_after_bytes"}`` (the process's
  resident set around the release).
- ``POST /wake_up``: the cache is re-created (``max_num_seqs`` x ``max_model_len``, as at start) and
  requests are admitted again: ``{"sleeping": false, "kv_bytes", "wake_s"}``.
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``: true from the moment ``/sleep`` closes admission
  (while it drains, too) until ``/wake_up``.

The states (:class:`SleepControl`, ``EngineService.sleep_state``): ``awake`` → ``draining`` (``/sleep``:
admission closed, admitted requests finishing) → ``asleep`` (cache released) → ``awake`` (``/wake_up``).
Requests are admitted only while ``awake``, so none ever lands on a released cache. Concurrent calls:

- a second ``/sleep`` while one drains joins it: it answers when the cache is released (with
  ``freed_kv_bytes: 0``, as a ``/sleep`` on a server already asleep does), or with the first one's 409;
- a ``/wake_up`` while a ``/sleep`` drains calls the sleep off: the cache was never released, admission
  reopens at once, and the pending ``/sleep`` calls answer 409 (``conflict``, not asleep); the end state
  is awake with a usable cache.

Every transition is one synchronous step on the event loop (no ``await`` between reading the state and
changing it), so they are serialised without a lock; the one wait, the drain, runs in a single task that
every ``/sleep`` joins, that outlives a client that leaves, and that ``/wake_up`` cancels by dropping it.

All three sit behind the server's API key (:mod:`.gate`), as ``/v1/*`` does: only the trainer that
started the server may put it to sleep.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations at build time
import asyncio
import time

from hybridflow.serve.protocol import APIError

SLEEP_WAIT_S = 30.0  # how long /sleep waits for admitted requests to finish
AWAKE, DRAINING, ASLEEP = "awake", "draining", "asleep"  # EngineService.sleep_state


def kv_bytes(engine) -> int:
    """Bytes held by the engine's KV cache tensors now (0 when released)."""
    return sum(t.numel() * t.element_size() for layer in engine.cache.layers for t in layer)


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc's ``malloc_trim``): after the first free of a large
    block glibc raises its mmap threshold, so the next cache comes from the heap and its free would
    otherwise stay in this process's resident set."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: nothing to trim
            pass


def rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _busy(service) -> bool:
    """Whether an admitted request is unanswered or the engine holds or steps one."""
    engine = service.engine
    return bool(service.in_flight or engine.has_unfinished() or getattr(engine, "_stepping_in_thread", False))


def _woken() -> APIError:
    return APIError(
        409, "POST /wake_up called the sleep off before the requests drained; not asleep", kind="conflict"
    )


class SleepControl:
    """Moves ``service.sleep_state`` (an :class:`EngineService`) between ``awake``, ``draining`` and
    ``asleep`` for the sleep routes (the module's docstring gives the semantics)."""

    def __init__(self, service) -> None:
        self.service = service
        self._drain: asyncio.Task | None = None  # the pending sleep, while the state is ``draining``

    async def sleep(self) -> dict:
        service = self.service
        if service.sleep_state == ASLEEP:
            return _asleep_answer()
        leader = service.sleep_state == AWAKE
        if leader:
            service.sleep_state = DRAINING  # admission closes now (EngineService.admitted)
            self._drain = asyncio.ensure_future(self._drain_and_release())
            self._drain.add_done_callback(_retrieve)
        answer = await asyncio.shield(self._drain)  # a client that leaves does not stop the sleep
        return answer if leader else _asleep_answer()

    async def _drain_and_release(self) -> dict:
        """Wait for the admitted requests, then release the cache, unless ``/wake_up`` dropped this
        task (409) or they outlast ``SLEEP_WAIT_S`` (409, awake again)."""
        service, me = self.service, asyncio.current_task()
        try:
            deadline = time.monotonic() + SLEEP_WAIT_S
            while _busy(service):
                if self._drain is not me:
                    raise _woken()
                if time.monotonic() > deadline:
                    raise APIError(
                        409, f"requests still running after {SLEEP_WAIT_S:g} s; not asleep", kind="conflict"
                    )
                await asyncio.sleep(0.01)
            if self._drain is not me:
                raise _woken()
            # from here to the end no await: nothing is admitted between the check and the release
            before, freed = rss_bytes(), kv_bytes(service.engine)
            service.engine.release()
            trim_heap()
            service.sleep_state, self._drain = ASLEEP, None
            return {
                "sleeping": True,
                "freed_kv_bytes": freed,
                "rss_before_bytes": before,
                "rss_after_bytes": rss_bytes(),
            }
        except BaseException:
            if self._drain is me:  # still this sleep's to undo (a timeout or a failed release): awake
                service.sleep_state, self._drain = AWAKE, None
            raise

    def wake_up(self) -> dict:
        service = self.service
        start = time.perf_counter()
        if service.sleep_state == DRAINING:  # the cache was never released: drop the pending sleep
            service.sleep_state, self._drain = AWAKE, None
        elif service.sleep_state == ASLEEP:
            service.engine.resume()
            service.sleep_state = AWAKE
        return {
            "sleeping": False,
            "kv_bytes": kv_bytes(service.engine),
            "wake_s": time.perf_counter() - start,
        }


def _asleep_answer() -> dict:
    """A ``/sleep`` that released nothing itself: the server was (or is now) asleep already."""
    rss = rss_bytes()
    return {"sleeping": True, "freed_kv_bytes": 0, "rss_before_bytes": rss, "rss_after_bytes": rss}


def _retrieve(task: asyncio.Task) -> None:
    """Mark the drain's error as seen (every ``/sleep`` awaiting it may have left)."""
    if not task.cancelled():
        task.exception()


def add_sleep_routes(app, service) -> None:
    """``/sleep``, ``/wake_up`` and ``/is_sleeping`` on ``app`` for ``service`` (:class:`EngineService`)."""
    control = SleepControl(service)

    @app.post("/sleep")
    async def sleep(level: int = 1):
        if level != 1:
            raise APIError(
                400, f"level={level}: only level 1 (the KV cache; a judge's weights stay)", param="level"
            )
        return await control.sleep()

    @app.post("/wake_up")
    async def wake_up():
        return control.wake_up()

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": service.sleep_state != AWAKE}
