"""The OpenAI API's request and response shapes, as far as ``hybridflow.serve`` answers them.

Requests are validated here (a malformed or out-of-range request is an :class:`APIError` carrying
the HTTP status and an OpenAI-style error body); responses are built from the engine's completions
(token ids, sampled log-probs, top alternatives) and the tokenizer.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 16  # stop strings per request, each of at most MAX_STOP_LENGTH characters
MAX_STOP_LENGTH = 256


class APIError(Exception):
    """An OpenAI-style error: ``status`` (4xx) and ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers

    def body(self) -> dict:
        code = {404: "model_not_found", 503: "server_busy"}.get(self.status)
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields of the API this server does not act on are ignored

    model: str
    n: int = Field(1, ge=1, le=128)  # and at most the server's --max-n
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    max_tokens: int | None = None
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False  # vLLM's extra sampling parameter: decode on past the stop tokens

    @field_validator("stop")
    @classmethod
    def _stop_strings_are_short(cls, stop):
        for text in [stop] if isinstance(stop, str) else stop or []:
            if len(text) > MAX_STOP_LENGTH:
                raise ValueError(f"a stop string may have at most {MAX_STOP_LENGTH} characters")
        return stop


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


def stop_strings(stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]


def stop_checker(tokenizer, stops: list[str]):
    """The engine's stop check for ``stops`` (None without any): whether the text of a sample's latest
    tokens contains one. It decodes only a tail long enough to hold the longest stop string (a token
    carries at least one byte, a character at most four), so a check costs the same at any length."""
    if not stops:
        return None
    window = 4 * max(len(s) for s in stops) + 4

    def check(token_ids: list[int]) -> bool:
        tail = tokenizer.decode(token_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    return check


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string (excluded), and whether one was found."""
    positions = [text.find(s) for s in stops if s in text]
    if not positions:
        return text, False
    return text[: min(positions)], True


def safe_prefix(text: str, stops: list[str]) -> str:
    """The part of a growing ``text`` that no stop string can still start in (for streaming)."""
    cut, found = cut_at_stop(text, stops)
    if found or not stops:
        return cut
    hold = max(len(s) for s in stops) - 1
    return text[: max(len(text) - hold, 0)]


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def token_logprob_entry(
    tokenizer, token_id: int, log_prob: float, top: list[tuple[int, float]] | None
) -> dict:
    """One element of a chat response's ``logprobs.content``."""
    text = tokenizer.decode([token_id])
    entry = {"token": text, "logprob": float(log_prob), "bytes": list(text.encode("utf-8"))}
    entry["top_logprobs"] = [
        {"token": (t := tokenizer.decode([tid])), "logprob": float(lp), "bytes": list(t.encode("utf-8"))}
        for tid, lp in (top or [])
    ]
    return entry


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


FinishReason = Literal["stop", "length", "tool_calls"]


def finish_reason(engine_reason: str, stopped_by_string: bool, has_tool_calls: bool) -> str:
    if has_tool_calls:
        return "tool_calls"
    if stopped_by_string or engine_reason == "stop":
        return "stop"
    return "length" if engine_reason == "length" else "stop"


def openai_tool_calls(calls) -> list[dict]:
    """Parsed :class:`~hybridflow.workers.rollout.tools.parser.ToolCall` s in the API's shape."""
    import json

    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in calls
    ]
