"""Parse tool calls out of model output text, one parser per chat format.

A parser turns one assistant message into ``(content, calls, errors)``: the text left once the
tool-call blocks are cut out, the well-formed calls in order, and one :class:`ParseError` per malformed
block (so the rollout can answer the model with the error instead of silently dropping the call).
Parsers never raise on model output, and run in time linear in its length: only the first
``max_chars`` characters are searched and at most ``max_calls`` blocks decoded, each excess reported
as one more error.

Formats live in :data:`TOOL_CALL_PARSERS`, keyed by the config value ``multi_turn.format``
(default ``"hermes"``). Add one with::

    @TOOL_CALL_PARSERS.register("my_format")
    class MyParser(ToolCallParser):
        def parse(self, text): ...
"""

from __future__ import annotations

import json
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
    except (ValueError, RecursionError) as exc:  # ValueError: also an integer of over 4300 digits
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
        except (ValueError, RecursionError) as exc:
            return ParseError(
                raw, f"arguments of {short_repr(name)} are a string that is not valid JSON: {exc}"
            )
    if not isinstance(arguments, dict):
        return ParseError(raw, f"arguments must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)


def short_repr(text: str, limit: int = 64) -> str:
    """``ascii()`` of at most ``limit`` characters of ``text``: safe for any string (lone surrogates and
    control characters come out escaped), so it can go into a message the tokenizer will encode."""
    shown = ascii(text[:limit])
    return shown if len(text) <= limit else f"{shown}... ({len(text)} characters)"


@TOOL_CALL_PARSERS.register("hermes")
class HermesParser(ToolCallParser):
    """Hermes/Qwen format: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    An opening tag with no closing tag before the end of the text (a truncated generation) is a
    malformed call: it yields a :class:`ParseError` and is removed from the content. A
    :class:`ParseError`'s ``raw`` is the whole block, tags included. A block runs from an opening tag to
    the first closing tag after it (an opening tag inside a block is part of its body). The scan is one
    left-to-right pass of ``str.find``, so no input makes it quadratic.
    """

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    max_chars = 1_000_000  # characters searched for calls; the rest is content only
    max_calls = 64  # blocks decoded per message

    def parse(self, text: str) -> tuple[str, list[ToolCall], list[ParseError]]:
        if not isinstance(text, str):
            text = "" if text is None else str(text)
        calls: list[ToolCall] = []
        errors: list[ParseError] = []
        content_parts: list[str] = []
        searched = text[: self.max_chars]
        position = blocks = 0
        while (start := searched.find(self.start_tag, position)) >= 0:
            content_parts.append(searched[position:start])
            end = searched.find(self.end_tag, start + len(self.start_tag))
            if end < 0:
                message = f"tool call is not terminated: missing {self.end_tag}"
                errors.append(ParseError(searched[start:], message))
                position = len(searched)
                break
            if blocks == self.max_calls:
                skipped = searched.count(self.start_tag, start)
                message = (
                    f"more than {self.max_calls} tool calls in one message: the last {skipped} were not read"
                )
                errors.append(ParseError(searched[start:], message))
                position = len(searched)
                break
            blocks += 1
            position = end + len(self.end_tag)
            body = searched[start + len(self.start_tag) : end]
            self._collect(decode_call(body.strip(), searched[start:position]), calls, errors)
        content_parts.append(text[position:])
        if self.start_tag in text[self.max_chars - len(self.start_tag) + 1 :]:
            message = (
                f"the message is {len(text)} characters long; tool calls after its first "
                f"{self.max_chars} characters are not read"
            )
            errors.append(ParseError(text[self.max_chars :], message))
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
