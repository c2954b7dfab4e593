"""What the reward-loop tests share: a real HTTP judge that misbehaves on purpose (hangs, answers garbage,
500s, 429s with Retry-After, or answers well after N refusals), in a thread of the test process."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class BadJudge:
    """``mode``: ``hang`` (never answers), ``garbage`` (200, not JSON), ``500``, ``429`` (with
    ``Retry-After: 0``), ``flaky`` (503 + Retry-After 0 for the first ``failures`` requests, then a chat
    completion whose content is ``content``). ``requests`` counts what reached it."""

    def __init__(self, mode: str, failures: int = 0, content: str = "correct") -> None:
        self.mode, self.failures, self.content = mode, failures, content
        self.requests = 0
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length", 0)))
                with judge.lock:
                    judge.requests += 1
                    count = judge.requests
                judge.answer(self, count)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.address = f"127.0.0.1:{self.server.server_address[1]}"

    def answer(self, handler, count: int) -> None:
        if self.mode == "hang":
            time.sleep(30)
            return
        if self.mode == "garbage":
            self._send(handler, 200, b"<html>not json</html>")
        elif self.mode == "500":
            self._send(handler, 500, json.dumps({"error": {"message": "judge broke"}}).encode())
        elif self.mode == "429":
            self._send(handler, 429, b'{"error": {"message": "slow down"}}', {"Retry-After": "0"})
        elif self.mode == "flaky" and count <= self.failures:
            self._send(handler, 503, b'{"error": {"message": "busy"}}', {"Retry-After": "0"})
        else:
            self._send(handler, 200, json.dumps(chat_answer(self.content)).encode())

    @staticmethod
    def _send(handler, status: int, body: bytes, headers: dict | None = None) -> None:
        handler.send_response(status)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(body)))
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def chat_answer(content: str) -> dict:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "judge",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
