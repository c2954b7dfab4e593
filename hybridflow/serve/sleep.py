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
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``.

All three sit behind the server's API key (:mod:`.gate`), as ``/v1/*`` does: only the trainer that
started the server may put it to sleep.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations at build time
import asyncio
import time

from hybridflow.serve.protocol import APIError

SLEEP_WAIT_S = 30.0  # how long /sleep waits for admitted requests to finish


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


async def _idle(service, wait_s: float) -> bool:
    """Whether every admitted request finished within ``wait_s`` (the engine not stepping)."""
    engine = service.engine
    deadline = time.monotonic() + wait_s
    while service.in_flight or engine.has_unfinished() or getattr(engine, "_stepping_in_thread", False):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def add_sleep_routes(app, service) -> None:
    """``/sleep``, ``/wake_up`` and ``/is_sleeping`` on ``app`` for ``service`` (:class:`EngineService`)."""

    @app.post("/sleep")
    async def sleep(level: int = 1):
        if level != 1:
            raise APIError(
                400, f"level={level}: only level 1 (the KV cache; a judge's weights stay)", param="level"
            )
        if service.sleeping:
            return {
                "sleeping": True,
                "freed_kv_bytes": 0,
                "rss_before_bytes": rss_bytes(),
                "rss_after_bytes": rss_bytes(),
            }
        service.sleeping = True
        if not await _idle(service, SLEEP_WAIT_S):
            service.sleeping = False
            raise APIError(
                409, f"requests still running after {SLEEP_WAIT_S:g} s; not asleep", kind="conflict"
            )
        before, freed = rss_bytes(), kv_bytes(service.engine)
        service.engine.release()
        trim_heap()
        return {
            "sleeping": True,
            "freed_kv_bytes": freed,
            "rss_before_bytes": before,
            "rss_after_bytes": rss_bytes(),
        }

    @app.post("/wake_up")
    async def wake_up():
        start = time.perf_counter()
        if service.sleeping:
            service.engine.resume()
            service.sleeping = False
        return {
            "sleeping": False,
            "kv_bytes": kv_bytes(service.engine),
            "wake_s": time.perf_counter() - start,
        }

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": bool(service.sleeping)}
