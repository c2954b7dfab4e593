"""An async HTTP client for served models (a GenRM judge, a teacher, any OpenAI-compatible server).

Reward functions import it: ``from hybridflow.utils.served_client import chat_complete`` is the
counterpart of the ``chat_complete(router_address, chat_complete_request)`` of verl's reward-loop tests,
and returns an ``openai`` ``ChatCompletion`` (``result.choices[0].message.content``). Under it,
:class:`ServedClient` posts JSON with the same rules for every endpoint (``/v1/chat/completions``,
``/v1/completions``, ``/classify``, a scoring endpoint):

- **timeouts**: every attempt is limited to ``timeout_s`` (connect, read, write, pool), and the whole
  call, retries and waits included, to ``total_timeout_s`` (None: ``timeout_s`` × attempts + waits);
- **retries** (``max_retries``, 0: none): a connection refused or reset and the statuses in
  ``retry_statuses`` (429, 502, 503, 504 by default: the server was busy or not there) are retried after
  an exponential backoff (``backoff_s`` · 2^attempt, at most ``max_backoff_s``, with jitter) or the
  server's ``Retry-After`` (seconds, capped at ``max_retry_after_s``) when it sends one, as
  ``hybridflow.serve`` does with its 503. A timed-out attempt is retried only with
  ``retry_timeouts=True`` (a slow judge asked again is slower still);
- **401** (``hybridflow.serve --api-key``): never retried; :class:`ServedModelError` says to pass
  ``api_key`` (default ``$HYBRIDFLOW_API_KEY``, sent as ``Authorization: Bearer``);
- any other 4xx/5xx, a body that is not JSON, or attempts exhausted: :class:`ServedModelError`, which
  names the URL, the status, the server's message and the attempts made.

Counting: each attempt's latency, retries and failures (by kind) go to the :class:`CallStats` the
caller opened with :func:`recording` (a context variable, so a reward manager counts what a user's
reward function did through this module without the function passing anything), and to the client's
own ``stats``.

The address may be ``host:port`` (verl's router address), ``http://host:port`` or end in ``/v1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CallStats",
    "ServedClient",
    "ServedModelError",
    "base_url",
    "chat_complete",
    "post_json",
    "recording",
]

DEFAULT_RETRY_STATUSES = (429, 502, 503, 504)


class ServedModelError(RuntimeError):
    """A request to a served model failed for good. ``kind``: ``http_<status>``, ``timeout``,
    ``connect``, ``bad_json`` or ``unauthorized``; ``status`` (None without an answer), ``url``,
    ``attempts``."""

    def __init__(self, message: str, *, kind: str, url: str, status: int | None = None, attempts: int = 1):
        super().__init__(message)
        self.kind, self.url, self.status, self.attempts = kind, url, status, attempts


@dataclass
class CallStats:
    """What the requests made under :func:`recording` did: ``latencies_s`` (one per answered
    attempt), ``retries``, ``failures`` (kind → count of requests that failed for good)."""

    latencies_s: list[float] = field(default_factory=list)
    retries: int = 0
    failures: Counter = field(default_factory=Counter)
    requests: int = 0

    def merge(self, other: CallStats) -> None:
        self.latencies_s += other.latencies_s
        self.retries += other.retries
        self.failures.update(other.failures)
        self.requests += other.requests


_CURRENT: contextvars.ContextVar[CallStats | None] = contextvars.ContextVar("served_call_stats", default=None)


@contextlib.contextmanager
def recording(stats: CallStats | None = None):
    """Count the requests made inside the block (and in tasks it starts) into ``stats`` (new if None)."""
    stats = stats if stats is not None else CallStats()
    token = _CURRENT.set(stats)
    try:
        yield stats
    finally:
        _CURRENT.reset(token)


def base_url(address: str) -> str:
    """``host:port`` / ``http://host:port[/v1][/]`` → ``http://host:port``."""
    address = address.strip().rstrip("/")
    if not address.startswith(("http://", "https://")):
        address = f"http://{address}"
    if address.endswith("/v1"):
        address = address[: -len("/v1")]
    return address


def _retry_after(headers, cap: float) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return min(max(float(value), 0.0), cap)
    except ValueError:  # an HTTP date: wait the cap rather than parse it
        return cap


def _server_message(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(body)[:300]


class ServedClient:
    """JSON over HTTP to one address with timeouts, retries and auth (module docstring). Use it as
    ``async with ServedClient(address) as client`` or call :meth:`aclose`; it keeps one connection
    pool, bound to the event loop it was first used in."""

    def __init__(
        self,
        address: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        total_timeout_s: float | None = None,
        max_retries: int = 3,
        retry_statuses: tuple[int, ...] = DEFAULT_RETRY_STATUSES,
        retry_timeouts: bool = False,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        max_retry_after_s: float = 30.0,
        max_connections: int = 256,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if timeout_s is None or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = base_url(address)
        self.api_key = api_key if api_key is not None else os.environ.get("HYBRIDFLOW_API_KEY")
        self.timeout_s, self.total_timeout_s = float(timeout_s), total_timeout_s
        self.max_retries, self.retry_statuses = int(max_retries), tuple(retry_statuses)
        self.retry_timeouts = bool(retry_timeouts)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.max_retry_after_s = float(max_retry_after_s)
        self.max_connections = int(max_connections)
        self.stats = CallStats()
        self._client = None

    async def __aenter__(self) -> ServedClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _http(self):
        import httpx

        if self._client is None:
            limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), limits=limits)
        return self._client

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_s(self, attempt: int) -> float:
        step = min(self.backoff_s * 2**attempt, self.max_backoff_s)
        return step * (0.5 + random.random() / 2)  # jitter: a burst does not come back at once

    def _count(self, what: str, value: Any = 1) -> None:
        for stats in (self.stats, _CURRENT.get()):
            if stats is None:
                continue
            if what == "latency":
                stats.latencies_s.append(value)
            elif what == "retry":
                stats.retries += 1
            elif what == "request":
                stats.requests += 1
            else:
                stats.failures[what] += 1

    async def post_json(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``path`` and return the JSON answer (module docstring for the rules)."""
        total = self.total_timeout_s
        if total is None:
            total = (self.timeout_s + self.max_retry_after_s) * (self.max_retries + 1)
        url = f"{self.url}/{path.lstrip('/')}"
        self._count("request")
        try:
            async with asyncio.timeout(total):
                return await self._attempts(url, body)
        except TimeoutError as error:
            self._count("timeout")
            raise ServedModelError(
                f"POST {url}: no answer within {total:.1f} s (all attempts)", kind="timeout", url=url
            ) from error
        except ServedModelError as error:
            self._count(error.kind)
            raise

    async def _attempts(self, url: str, body: dict) -> dict:
        import httpx

        attempt = 0
        while True:
            wait, failure = None, None
            start = time.monotonic()
            try:
                response = await self._http().post(url, json=body, headers=self._headers())
            except httpx.TimeoutException as error:
                failure = ServedModelError(
                    f"POST {url}: no answer within {self.timeout_s:.1f} s (attempt {attempt + 1})",
                    kind="timeout", url=url, attempts=attempt + 1,
                )  # fmt: skip
                if not self.retry_timeouts:
                    raise failure from error
            except httpx.TransportError as error:  # refused, reset, DNS: the server is not there (yet)
                message = f"POST {url}: {type(error).__name__}: {error}"
                failure = ServedModelError(message, kind="connect", url=url, attempts=attempt + 1)
            else:
                self._count("latency", time.monotonic() - start)
                if response.status_code == 200:
                    try:
                        return response.json()
                    except ValueError as error:
                        raise ServedModelError(
                            f"POST {url}: the answer is not JSON: {response.text[:200]!r}",
                            kind="bad_json", url=url, status=200, attempts=attempt + 1,
                        ) from error  # fmt: skip
                failure = self._refused(url, response, attempt)
                wait = _retry_after(response.headers, self.max_retry_after_s)
            if attempt >= self.max_retries:
                raise failure
            self._count("retry")
            await asyncio.sleep(wait if wait is not None else self._wait_s(attempt))
            attempt += 1

    def _refused(self, url: str, response, attempt: int) -> ServedModelError:
        """The error for a non-200 answer; raised at once if the status is not retried."""
        status, message = response.status_code, _server_message(response)
        if status == 401:
            raise ServedModelError(
                f"POST {url}: 401 Unauthorized ({message}): the server wants an API key; pass "
                "api_key= or set HYBRIDFLOW_API_KEY (sent as 'Authorization: Bearer <key>')",
                kind="unauthorized", url=url, status=401, attempts=attempt + 1,
            )  # fmt: skip
        error = ServedModelError(
            f"POST {url}: HTTP {status}: {message} (attempt {attempt + 1} of {self.max_retries + 1})",
            kind=f"http_{status}", url=url, status=status, attempts=attempt + 1,
        )  # fmt: skip
        if status not in self.retry_statuses:
            raise error
        return error

    async def chat_complete(self, request: dict):
        """``POST /v1/chat/completions`` → an ``openai.types.chat.ChatCompletion``."""
        answer = await self.post_json("/v1/chat/completions", request)
        return _chat_completion(answer, self.url)


def _chat_completion(answer: dict, url: str):
    try:
        from openai.types.chat import ChatCompletion
    except ImportError as error:  # pragma: no cover - openai is in the dev and serve extras
        raise ImportError("chat_complete returns openai's ChatCompletion: pip install openai") from error
    try:
        return ChatCompletion.model_validate(answer)
    except Exception as error:
        raise ServedModelError(
            f"POST {url}/v1/chat/completions: the answer is not a chat completion: {error}",
            kind="bad_json", url=url, status=200,
        ) from error  # fmt: skip


async def post_json(address: str, path: str, body: dict, **client_kwargs) -> dict:
    """One JSON POST to ``address`` + ``path`` with a client made for it (``client_kwargs``:
    :class:`ServedClient`'s)."""
    async with ServedClient(address, **client_kwargs) as client:
        return await client.post_json(path, body)


async def chat_complete(router_address: str, chat_complete_request: dict, **client_kwargs):
    """verl's reward-loop ``chat_complete``: ``chat_complete_request`` (``messages``, ``model``,
    sampling fields) to ``router_address``'s ``/v1/chat/completions``; returns a ``ChatCompletion``.
    ``client_kwargs``: :class:`ServedClient`'s (``api_key``, ``timeout_s``, ``max_retries``, ...)."""
    async with ServedClient(router_address, **client_kwargs) as client:
        return await client.chat_complete(chat_complete_request)
