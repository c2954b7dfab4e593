"""A chat completion as server-sent events, as OpenAI streams it.

One role chunk per choice, then content deltas as tokens arrive (text that a stop string or a Hermes
``<tool_call>`` block could still be forming in is held back), each carrying the log-probs of the tokens
it covers when asked (``logprobs``/``top_logprobs``). A choice ends with its tool calls (when the model
wrote Hermes calls and tools were offered) or the rest of its text, then a chunk with the finish reason,
and the stream with ``[DONE]``. Stop strings have already ended decoding in the engine.
"""

from __future__ import annotations

import json

from hybridflow.serve.protocol import (
    ChatCompletionRequest,
    cut_at_stop,
    finish_reason,
    now,
    openai_tool_calls,
    safe_prefix,
    stop_strings,
    token_logprob_entry,
)
from hybridflow.workers.rollout.engine.requests import EngineRequestError

TOOL_CALL_START = "<tool_call>"


async def chat_events(service, request: ChatCompletionRequest, stream_id: str, first, stream):
    """The events of one streamed chat completion: ``first`` is the engine stream's first event (read
    before the response started, so that a refused request is a 4xx), ``stream`` the rest of it."""
    tokenizer, created = service.tokenizer, now()
    tools_on = bool(request.tools) and request.tool_choice != "none"
    stops = stop_strings(request.stop)
    holds = stops + ([TOOL_CALL_START] if tools_on else [])

    def chunk(index: int, delta: dict, reason: str | None = None, logprobs=None) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        body = {
            "id": stream_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": service.model_name,
            "choices": [choice],
        }
        return f"data: {json.dumps(body)}\n\n"

    tokens: list[list[int]] = [[] for _ in range(request.n)]
    entries: list[list[dict]] = [[] for _ in range(request.n)]  # log-probs not yet sent
    sent = [""] * request.n

    def flush_logprobs(index: int):
        if not request.logprobs or not entries[index]:
            return None
        out, entries[index] = {"content": entries[index]}, []
        return out

    for index in range(request.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    result, event = None, first
    while True:
        if isinstance(event, tuple):  # (sample, token, log-prob, top alternatives): one new token
            index, token, log_prob, top = event
            tokens[index].append(token)
            if request.logprobs:
                entries[index].append(token_logprob_entry(tokenizer, token, log_prob, top))
            text = safe_prefix(tokenizer.decode(tokens[index], skip_special_tokens=True), holds)
            if len(text) > len(sent[index]):
                yield chunk(index, {"content": text[len(sent[index]) :]}, logprobs=flush_logprobs(index))
                sent[index] = text
        else:
            result = event
            break
        try:
            event = await anext(stream, None)
        except EngineRequestError as error:  # this request failed in the engine: say so and end
            message = f"The request failed in the engine: {error}"
            body = {"error": {"message": message, "type": "internal_error"}}
            yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            return
        if event is None:
            break
    for index, completion in enumerate(result.completions):
        text, stopped = cut_at_stop(tokenizer.decode(completion.token_ids, skip_special_tokens=True), stops)
        calls = []
        if tools_on and TOOL_CALL_START in text:
            from hybridflow.workers.rollout.tools.parser import get_tool_call_parser

            _content, parsed, _ = get_tool_call_parser("hermes").parse(text)
            calls = openai_tool_calls(parsed) if parsed else []
        if calls:
            deltas = [{"index": i, **call} for i, call in enumerate(calls)]
            yield chunk(index, {"tool_calls": deltas}, logprobs=flush_logprobs(index))
        elif len(text) > len(sent[index]) or entries[index]:
            yield chunk(index, {"content": text[len(sent[index]) :]}, logprobs=flush_logprobs(index))
        yield chunk(index, {}, finish_reason(completion.finish_reason, stopped, bool(calls)))
    yield "data: [DONE]\n\n"
