"""Parse tool calls out of model output text, one parser per chat format.

A parser turns one assistant message into ``(content, calls, errors)``: the text left once the
tool-call blocks are cut out, the well-formed calls in order, and one :class:`ParseError` per malformed
block (so the rollout can answer the model with the error instead of silently dropping the call).
Parsers never raise on model output.

Formats live in :data:`TOOL_CALL_PARSERS`, keyed by the config value ``multi_turn.format``
(default ``"hermes"``). Add one with::

    @TOOL_CALL_PARSERS.register("my_format")
    class MyParser(ToolCallParser):
        def parse(self, text): ...
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from hybridflow.utils.registry import Registry


@dataclass
class ToolCall:
    """One well-formed call: the tool's function name and its decoded JSON-object arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParseError:
    """One malformed call: ``raw`` is the offending text as the model wrote it, ``message`` says why."""

    raw: str
    message: str


class ToolCallParser:
    """Base class: subclasses implement :meth:`parse` for one chat format."""

    def parse(self, text: str) -> tuple[str, list[ToolCall], list[ParseError]]:
        """Return ``(content without tool-call blocks, stripped; calls in order; errors in order)``."""
        raise NotImplementedError


TOOL_CALL_PARSERS: Registry[type[ToolCallParser]] = Registry("tool call format")


def decode_call(body: str, raw: str) -> ToolCall | ParseError:
    """Decode a ``{"name": ..., "arguments": {...}}`` JSON body into a call or an error.

    ``arguments`` may be a JSON object, a string holding a JSON object (some Qwen checkpoints emit
    this), or absent/``null``/``""`` for a call without arguments.
    """
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return ParseError(raw, f"tool call is not valid JSON: {exc}")
    if not isinstance(payload, dict):
        return ParseError(raw, f"tool call must be a JSON object, got {type(payload).__name__}")
    name = payload.get("name")
    if name is None or name == "":
        return ParseError(raw, "tool call has no 'name'")
    if not isinstance(name, str):
        return ParseError(raw, f"tool call 'name' must be a string, got {type(name).__name__}")
    arguments = payload.get("arguments")
    if arguments is None or arguments == "":
        return ToolCall(name, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as exc:
            return ParseError(raw, f"arguments of {name!r} are a string that is not valid JSON: {exc}")
    if not isinstance(arguments, dict):
        return ParseError(raw, f"arguments must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)


@TOOL_CALL_PARSERS.register("hermes")
class HermesParser(ToolCallParser):
    """Hermes/Qwen format: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    An opening tag with no closing tag before the end of the text (a truncated generation) is a
    malformed call: it yields a :class:`ParseError` and is removed from the content. A
    :class:`ParseError`'s ``raw`` is the whole block, tags included.
    """

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self) -> None:
        self._block = re.compile(re.escape(self.start_tag) + r"(.*?)" + re.escape(self.end_tag), re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall], list[ParseError]]:
        if not isinstance(text, str):
            text = "" if text is None else str(text)
        calls: list[ToolCall] = []
        errors: list[ParseError] = []
        content_parts: list[str] = []
        position = 0
        for match in self._block.finditer(text):
            content_parts.append(text[position : match.start()])
            position = match.end()
            self._collect(decode_call(match.group(1).strip(), match.group(0)), calls, errors)
        tail = text[position:]
        unterminated = tail.find(self.start_tag)
        if unterminated >= 0:
            content_parts.append(tail[:unterminated])
            errors.append(
                ParseError(tail[unterminated:], f"tool call is not terminated: missing {self.end_tag}")
            )
        else:
            content_parts.append(tail)
        return "".join(content_parts).strip(), calls, errors

    @staticmethod
    def _collect(result: ToolCall | ParseError, calls: list[ToolCall], errors: list[ParseError]) -> None:
        if isinstance(result, ToolCall):
            calls.append(result)
        else:
            errors.append(result)


def get_tool_call_parser(name: str = "hermes") -> ToolCallParser:
    """A new parser for format ``name``; a ``RegistryError`` (a ``ValueError``) lists known formats."""
    return TOOL_CALL_PARSERS.get(name)()
