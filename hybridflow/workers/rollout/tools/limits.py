"""How many calls of an HTTP tool are in flight at once: verl's ``num_workers`` and ``rate_limit``.

verl gives each such tool (``SandboxFusionTool``, ``SearchTool``) a Ray thread pool of ``num_workers``
and, with ``enable_global_rate_limit`` (default true), a cluster-wide token bucket of ``rate_limit``
calls in flight. Here a call holds this tool's ``num_workers`` semaphore, then the process-wide one of its
kind (sized by the first tool of that kind to make it). asyncio primitives belong to one event loop, so
both are kept per loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator
from typing import Any

_Semaphores = weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]
_SHARED: dict[str, _Semaphores] = {}  # kind -> the process-wide limiter of each event loop


class CallLimits:
    """``async with limits.hold():`` around one call (module docstring). ``rate_limit=None``: no
    process-wide limit (verl's ``enable_global_rate_limit: false``)."""

    def __init__(self, kind: str, num_workers: int, rate_limit: int | None) -> None:
        self.kind, self.num_workers, self.rate_limit = kind, num_workers, rate_limit
        self._own: _Semaphores = weakref.WeakKeyDictionary()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        own = self._own.setdefault(loop, asyncio.Semaphore(self.num_workers))
        shared: Any = contextlib.nullcontext()
        if self.rate_limit is not None:
            per_loop = _SHARED.setdefault(self.kind, weakref.WeakKeyDictionary())
            shared = per_loop.setdefault(loop, asyncio.Semaphore(self.rate_limit))
        async with own, shared:
            yield


def from_config(kind: str, config: dict[str, Any], num_workers: int, rate_limit: int) -> CallLimits:
    """The limits of verl's keys ``num_workers``, ``rate_limit`` and ``enable_global_rate_limit`` in
    ``config``, with these defaults (each must be at least 1)."""
    workers = positive_int(config, "num_workers", num_workers)
    rate = positive_int(config, "rate_limit", rate_limit)
    return CallLimits(kind, workers, rate if bool(config.get("enable_global_rate_limit", True)) else None)


def positive_int(config: dict[str, Any], key: str, default: int) -> int:
    value = int(config.get(key, default))
    if value < 1:
        raise ValueError(f"{key} must be at least 1, got {value}")
    return value
