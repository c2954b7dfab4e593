"""What a request passes before the app reads it: the API key and the body size (an ASGI middleware).

- ``api_key``: every ``/v1/*`` request, ``/stats``, ``/metrics``, ``/classify`` and the sleep endpoints
  must carry ``Authorization: Bearer <key>`` (vLLM's ``--api-key``); ``/health`` stays open for load
  balancers.
  A wrong or missing key is a 401 in OpenAI's error shape, answered before the body is read.
- ``max_body_bytes``: a body longer than this (by its ``Content-Length`` or as it streams in) is a 413,
  and is never held in memory whole. The body read here is handed on to the app, and the messages
  after it (a client's disconnect) pass through, so the app can still notice a client that left.
"""

from __future__ import annotations

import hmac
import json


def error_body(status: int, message: str, kind: str, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


PROTECTED = ("/stats", "/metrics", "/classify", "/sleep", "/wake_up", "/is_sleeping")  # besides /v1/*


class RequestGate:
    """ASGI middleware in front of ``app``: ``api_key`` (None: open) and ``max_body_bytes``."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key or None, int(max_body_bytes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and self._protected(scope.get("path", "")):
            given = headers.get("authorization", "")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode()):
                message = "Incorrect API key provided."
                body = error_body(401, message, "invalid_request_error", "invalid_api_key")
                await _answer(send, 401, body, {"www-authenticate": "Bearer"})
                return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._too_large(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        handed = False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return whole
            return await receive()  # after the body: the client's disconnect

        await self.app(scope, replay, send)

    @staticmethod
    def _protected(path: str) -> bool:
        return path in PROTECTED or path.startswith("/v1/") or path == "/v1"

    async def _too_large(self, send) -> None:
        message = f"The request body is larger than this server's limit of {self.max_body_bytes} bytes."
        await _answer(send, 413, error_body(413, message, "invalid_request_error", "request_too_large"))


async def _answer(send, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
