"""The OpenAI-compatible HTTP app over hybridflow's engine (FastAPI; ``python -m hybridflow.serve``).

Endpoints: ``GET /health``, ``GET /stats`` (the engine's counters), ``GET /v1/models``,
``POST /v1/chat/completions`` (n, temperature, top_p, max_tokens / max_completion_tokens, stop, seed,
logprobs / top_logprobs, tools → ``tool_calls`` parsed from Hermes blocks, streaming) and
``POST /v1/completions`` (text or token prompts, logprobs). Every request is one engine request, so
concurrent requests share the engine's running batch.

Bad requests get an OpenAI-style error body and the server keeps serving: malformed JSON or a field
out of range (400), an unknown model (404), a prompt longer than the model (400), greedy sampling with
``n > 1`` (400, as vLLM's server answers: the samples would all be the same).
"""

from __future__ import annotations

import json
from typing import Any

from hybridflow.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    completion_id,
    cut_at_stop,
    finish_reason,
    now,
    openai_tool_calls,
    safe_prefix,
    stop_strings,
    token_logprob_entry,
    usage,
)


class EngineService:
    """Turns API requests into engine requests: ``engine`` (:class:`LLMEngine`), ``tokenizer``,
    ``model_name`` (what clients put in ``model``), ``eos_ids`` (stop tokens)."""

    def __init__(self, engine, tokenizer, model_name: str, eos_ids: list[int]) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.eos_ids = list(eos_ids)

    # ------------------------------------------------------------------ request checks
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", kind="NotFoundError")

    def params(self, request, prompt_len: int, top_logprobs: int = 0):
        """The engine's sampling parameters for ``request`` (the API's defaults: temperature 1)."""
        from hybridflow.workers.rollout.engine import SamplingParams

        max_len = self.engine.max_model_len
        if prompt_len >= max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                f"{prompt_len} tokens, leaving no room to generate.",
                param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            )
        wanted = getattr(request, "max_completion_tokens", None) or request.max_tokens
        if wanted is not None and wanted < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {wanted}.", param="max_tokens")
        if wanted is not None and prompt_len + wanted > max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} for the completion).",
                param="max_tokens",
            )
        temperature = 1.0 if request.temperature is None else float(request.temperature)
        if temperature == 0 and request.n > 1:
            raise APIError(400, "n must be 1 when using greedy sampling.", param="n")
        return SamplingParams(
            max_new_tokens=int(wanted or max_len - prompt_len),
            temperature=temperature,
            top_p=1.0 if request.top_p is None else float(request.top_p),
            top_k=int(request.top_k) if request.top_k else -1,
            do_sample=temperature > 0,
            stop_token_ids=tuple(self.eos_ids),
            seed=request.seed,
            logprobs=int(top_logprobs),
        )

    def chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(
                request.messages, tools=request.tools or None, add_generation_prompt=True, tokenize=True
            )
        except Exception as error:  # a message the template cannot render
            raise APIError(
                400, f"messages could not be rendered by the chat template: {error}", param="messages"
            ) from error
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt, add_special_tokens=False)]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [
            self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
            for p in prompt
        ]

    # ------------------------------------------------------------------ responses
    def chat_choice(self, index: int, completion, request: ChatCompletionRequest) -> dict:
        text, stopped = cut_at_stop(
            self.tokenizer.decode(completion.token_ids, skip_special_tokens=True), stop_strings(request.stop)
        )
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = []
        if request.tools and request.tool_choice != "none":
            from hybridflow.workers.rollout.tools.parser import get_tool_call_parser

            content, parsed, _ = get_tool_call_parser("hermes").parse(text)
            if parsed:
                calls = openai_tool_calls(parsed)
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        choice = {
            "index": index,
            "message": message,
            "finish_reason": finish_reason(completion.finish_reason, stopped, bool(calls)),
            "logprobs": None,
        }
        if request.logprobs:
            tops = completion.top_log_probs or [None] * len(completion.token_ids)
            choice["logprobs"] = {
                "content": [
                    token_logprob_entry(self.tokenizer, t, lp, top)
                    for t, lp, top in zip(completion.token_ids, completion.log_probs, tops, strict=True)
                ]
            }
        return choice

    def completion_choice(self, index: int, completion, request: CompletionRequest, prompt_text: str) -> dict:
        text, stopped = cut_at_stop(
            self.tokenizer.decode(completion.token_ids, skip_special_tokens=True), stop_strings(request.stop)
        )
        choice = {
            "index": index,
            "text": (prompt_text if request.echo else "") + text,
            "finish_reason": finish_reason(completion.finish_reason, stopped, False),
            "logprobs": None,
        }
        if request.logprobs is not None:
            tokens = [self.tokenizer.decode([t]) for t in completion.token_ids]
            tops = completion.top_log_probs or [[] for _ in tokens]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": [float(x) for x in completion.log_probs],
                "top_logprobs": [{self.tokenizer.decode([t]): float(lp) for t, lp in top} for top in tops],
                "text_offset": [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))],
            }
        return choice

    # ------------------------------------------------------------------ endpoints
    async def chat(self, request: ChatCompletionRequest) -> dict:
        self.check_model(request.model)
        prompt = self.chat_prompt(request)
        params = self.params(request, len(prompt), (request.top_logprobs or 0) if request.logprobs else 0)
        result = await self.engine.generate(prompt, params, n=request.n)
        choices = [self.chat_choice(i, c, request) for i, c in enumerate(result.completions)]
        return {
            "id": completion_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(len(prompt), sum(len(c.token_ids) for c in result.completions)),
        }

    async def completions(self, request: CompletionRequest) -> dict:
        self.check_model(request.model)
        prompts = self.completion_prompts(request)
        params = [self.params(request, len(p), request.logprobs or 0) for p in prompts]
        choices, generated = [], 0
        for prompt, prompt_params in zip(prompts, params, strict=True):
            result = await self.engine.generate(prompt, prompt_params, n=request.n)
            prompt_text = self.tokenizer.decode(prompt)
            for completion in result.completions:
                choices.append(self.completion_choice(len(choices), completion, request, prompt_text))
                generated += len(completion.token_ids)
        return {
            "id": completion_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(sum(len(p) for p in prompts), generated),
        }

    async def chat_stream(self, request: ChatCompletionRequest):
        """Server-sent events: a role chunk per choice, content deltas as tokens arrive (held back while a
        stop string could still be forming), a final chunk with the finish reason, then ``[DONE]``."""
        self.check_model(request.model)
        prompt = self.chat_prompt(request)
        params = self.params(request, len(prompt))
        stream_id, created = completion_id("chatcmpl"), now()
        stops = stop_strings(request.stop)

        def chunk(index: int, delta: dict, reason: str | None = None) -> str:
            body = {
                "id": stream_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}],
            }
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            tokens: list[list[int]] = [[] for _ in range(request.n)]
            sent = [""] * request.n
            for index in range(request.n):
                yield chunk(index, {"role": "assistant", "content": ""})
            result = None
            async for event in self.engine.stream(prompt, params, n=request.n):
                if isinstance(event, tuple):  # (sample, token, log_prob): one new token
                    index, token = event[0], event[1]
                    tokens[index].append(token)
                    text = safe_prefix(self.tokenizer.decode(tokens[index], skip_special_tokens=True), stops)
                    if len(text) > len(sent[index]):
                        yield chunk(index, {"content": text[len(sent[index]) :]})
                        sent[index] = text
                else:
                    result = event
            for index, completion in enumerate(result.completions):
                text, stopped = cut_at_stop(
                    self.tokenizer.decode(completion.token_ids, skip_special_tokens=True), stops
                )
                if len(text) > len(sent[index]):
                    yield chunk(index, {"content": text[len(sent[index]) :]})
                yield chunk(index, {}, finish_reason(completion.finish_reason, stopped, False))
            yield "data: [DONE]\n\n"

        return events()


def build_app(service: EngineService):
    """The FastAPI app answering the OpenAI endpoints with ``service``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="hybridflow.serve")

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError):
        details = error.errors()
        first = details[0] if details else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', ())[1:]) or 'body'}: {d.get('msg')}" for d in details
        )
        return JSONResponse(APIError(400, message or "invalid request", param=where).body(), status_code=400)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        """hybridflow's own: the engine's counters (prefill tokens, decode steps, generated tokens)."""
        return {**service.engine.stats, "running": service.engine.num_running}

    @app.get("/v1/models")
    async def models():
        card = {"id": service.model_name, "object": "model", "created": now(), "owned_by": "hybridflow"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest):
        if request.stream:
            return StreamingResponse(await service.chat_stream(request), media_type="text/event-stream")
        return await service.chat(request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        if request.stream:
            raise APIError(
                400, "streaming is served for /v1/chat/completions; set stream=false here", param="stream"
            )
        return await service.completions(request)

    return app
