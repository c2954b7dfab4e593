"""The OpenAI-compatible HTTP app over hybridflow's engine (FastAPI; ``python -m hybridflow.serve``).

Endpoints: ``GET /health``, ``GET /stats`` (the engine's counters), ``GET /metrics`` (Prometheus, vLLM's
names: :mod:`hybridflow.serve.metrics`), ``GET /v1/models``,
``POST /sleep`` / ``/wake_up`` / ``GET /is_sleeping`` (:mod:`.sleep`),
``POST /v1/chat/completions`` (n, temperature, top_p, max_tokens / max_completion_tokens, stop, seed,
logprobs / top_logprobs, tools → ``tool_calls`` parsed from Hermes blocks, streaming with log-probs and
tool calls) and ``POST /v1/completions`` (text or token prompts, logprobs). Every request is one engine
request, so concurrent requests share the engine's running batch; the engine steps in its own thread,
so ``/health`` answers during a long prefill.

Bad requests get an OpenAI-style error body and the server keeps serving: malformed JSON or a field
out of range (400), token ids outside the vocabulary, a seed beyond int64, ``n`` above ``--max-n`` or
more prompts than ``--max-prompts`` (400), more sequences (``n`` x prompts) than the server holds at
once, its cache slots plus ``--max-waiting`` (400: waiting would not help), an unknown model (404), a
prompt longer than the model (400), greedy sampling with ``n > 1`` (400, as vLLM's server answers: the
samples would all be the same), a body over ``--max-request-bytes`` (413), a wrong API key (401,
:mod:`.gate`), a full waiting list (503 with ``Retry-After``; admission counts sequences, so a request's
``n`` samples take ``n`` places, :meth:`EngineService.admitted`). A request that fails inside the engine
fails alone (500 for it, the batch goes on). Stop strings end decoding in the engine; a client that
disconnects has its request aborted and its cache slots freed.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations (Request) at build time
import asyncio
import contextlib
from dataclasses import dataclass
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
    stop_checker,
    stop_strings,
    token_logprob_entry,
    usage,
)


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask and how much may wait (``python -m hybridflow.serve`` flags)."""

    max_n: int = 32  # samples per request (--max-n)
    max_prompts: int = 32  # prompts in one /v1/completions request (--max-prompts)
    max_waiting: int = 256  # sequences (n per prompt) queued for a cache slot beyond them (--max-waiting)
    retry_after_s: int = 1  # the Retry-After a 503 carries


class EngineService:
    """Turns API requests into engine requests: ``engine`` (:class:`LLMEngine`), ``tokenizer``,
    ``model_name`` (what clients put in ``model``), ``eos_ids`` (stop tokens), ``limits``."""

    def __init__(
        self, engine, tokenizer, model_name: str, eos_ids: list[int], limits: ServerLimits | None = None
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.eos_ids = list(eos_ids)
        self.limits = limits or ServerLimits()
        self.vocab_size = int(engine.model.full_spec.vocab_size)
        self.in_flight = 0  # sequences (n per prompt) admitted by :meth:`admitted` and not yet answered
        self.sleep_state = "awake"  # or "draining" / "asleep" (.sleep): requests get 503 unless awake

    @property
    def sleeping(self) -> bool:
        """Whether admission is closed by ``POST /sleep`` (draining or asleep, :mod:`.sleep`)."""
        return self.sleep_state != "awake"

    @property
    def capacity(self) -> int:
        """Sequences admitted at once at most: the engine's running rows (``max_num_seqs``) plus
        ``max_waiting`` queued beyond them."""
        return self.engine.max_num_seqs + self.limits.max_waiting

    # ------------------------------------------------------------------ request checks
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", kind="NotFoundError")

    def check_limits(self, request, prompts: int = 1) -> None:
        """``n``, the prompt count and the sequences they make (``n`` x prompts) against the limits."""
        if request.n > self.limits.max_n:
            raise APIError(400, f"n={request.n} is above this server's limit of {self.limits.max_n}.", "n")
        if prompts > self.limits.max_prompts:
            most = self.limits.max_prompts
            raise APIError(400, f"{prompts} prompts in one request; the most is {most}.", "prompt")
        sequences = request.n * prompts
        if sequences > self.capacity:
            asked = f"n={request.n}" + (
                f" x {prompts} prompts = {sequences} sequences" if prompts > 1 else ""
            )
            raise APIError(400, f"{asked} is above {self._holds()}; ask for fewer samples.", "n")

    def _holds(self) -> str:
        rows, waiting = self.engine.max_num_seqs, self.limits.max_waiting
        return (
            f"the {self.capacity} sequences this server holds at once ({rows} running (max_num_seqs) + "
            f"--max-waiting {waiting})"
        )

    @contextlib.contextmanager
    def admitted(self, sequences: int):
        """Hold ``sequences`` places (a request's ``n`` x its prompts: what it takes of the KV cache)
        until the block ends, however it ends. A request that would not fit an idle server
        (:attr:`capacity`) is a 400; one that does not fit beside those in flight now, or any while the
        server sleeps or drains for a sleep (:mod:`.sleep`), a 503 with Retry-After: it is refused, not
        queued, so the client retries it (at most ``capacity`` sequences wait on the engine)."""
        if sequences > self.capacity:
            raise APIError(400, f"{sequences} sequences in one request is above {self._holds()}; send fewer.")
        if self.sleeping:
            raise APIError(
                503,
                "The server is asleep (its KV cache released); retry after it wakes.",
                kind="server_busy",
                headers={"Retry-After": str(self.limits.retry_after_s)},
            )
        if self.in_flight + sequences > self.capacity:
            waiting = max(self.in_flight - self.engine.max_num_seqs, 0)
            raise APIError(
                503,
                f"The server is busy: {waiting} sequences are waiting to run and this request "
                f"needs {sequences} places of the {self.capacity - self.in_flight} free. Retry later.",
                kind="server_busy",
                headers={"Retry-After": str(self.limits.retry_after_s)},
            )
        self.in_flight += sequences
        try:
            yield
        finally:
            self.in_flight -= sequences

    def check_tokens(self, prompt: list[int], param: str) -> None:
        if not prompt:
            raise APIError(400, "The prompt is empty.", param=param)
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"Token id {bad} is outside the model's vocabulary [0, {self.vocab_size}).", param=param
            )

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
        chat_limit = request.max_completion_tokens if isinstance(request, ChatCompletionRequest) else None
        wanted = chat_limit or request.max_tokens
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
            stop_token_ids=() if request.ignore_eos else tuple(self.eos_ids),
            seed=request.seed,
            logprobs=int(top_logprobs),
            ignore_eos=request.ignore_eos,
            stop_checker=stop_checker(self.tokenizer, stop_strings(request.stop)),
        )

    async def run(self, prompt: list[int], params, n: int, request_id: str):
        """One engine request: a request the engine refuses is a 400, one that fails in it a 500."""
        from hybridflow.workers.rollout.engine import EngineRequestError

        try:
            return await self.engine.generate(prompt, params, n=n, request_id=request_id)
        except ValueError as error:
            raise APIError(400, str(error)) from error
        except EngineRequestError as error:
            raise _failed_in_engine(error) from error

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
            prompts = [self.tokenizer.encode(prompt, add_special_tokens=False)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [
                self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
                for p in prompt
            ]
        if not prompts:
            raise APIError(400, "The prompt is empty.", param="prompt")
        for ids in prompts:
            self.check_tokens(ids, "prompt")
        return prompts

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
        self.check_limits(request)
        prompt = self.chat_prompt(request)
        params = self.params(request, len(prompt), (request.top_logprobs or 0) if request.logprobs else 0)
        with self.admitted(request.n):
            result = await self.run(prompt, params, request.n, completion_id("chatcmpl"))
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
        """Every prompt of the request runs at once (they share the engine's batch)."""
        self.check_model(request.model)
        prompts = self.completion_prompts(request)
        self.check_limits(request, len(prompts))
        params = [self.params(request, len(p), request.logprobs or 0) for p in prompts]
        request_id = completion_id("cmpl")
        with self.admitted(len(prompts) * request.n):
            results = await _gather_or_cancel(
                [
                    self.run(prompt, prompt_params, request.n, f"{request_id}-{i}")
                    for i, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True))
                ]
            )
        choices, generated = [], 0
        for prompt, result in zip(prompts, results, strict=True):
            prompt_text = self.tokenizer.decode(prompt)
            for completion in result.completions:
                choices.append(self.completion_choice(len(choices), completion, request, prompt_text))
                generated += len(completion.token_ids)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(sum(len(p) for p in prompts), generated),
        }

    async def chat_stream(self, request: ChatCompletionRequest):
        """Server-sent events (:mod:`.streaming`); the request is checked and queued before the first
        byte, so a bad request is a 4xx, not a broken stream."""
        from hybridflow.serve.streaming import chat_events
        from hybridflow.workers.rollout.engine import EngineRequestError

        self.check_model(request.model)
        self.check_limits(request)
        prompt = self.chat_prompt(request)
        params = self.params(request, len(prompt), (request.top_logprobs or 0) if request.logprobs else 0)
        request_id = completion_id("chatcmpl")
        admission = self.admitted(request.n)
        admission.__enter__()  # held until the events end (:func:`_until_done`)
        try:
            stream = self.engine.stream(prompt, params, n=request.n, request_id=request_id)
            first = await anext(stream)  # the engine checks the request here (a ValueError: a 400)
        except BaseException as error:
            admission.__exit__(None, None, None)
            if isinstance(error, ValueError):
                raise APIError(400, str(error)) from error
            if isinstance(error, EngineRequestError):
                raise _failed_in_engine(error) from error
            raise
        return request_id, chat_events(self, request, request_id, first, stream), admission


def _failed_in_engine(error: Exception) -> APIError:
    return APIError(500, f"The request failed in the engine: {error}", kind="internal_error")


async def _gather_or_cancel(calls: list) -> list:
    """``asyncio.gather`` that cancels the other calls when one fails (their engine requests abort)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _abort_on_disconnect(http_request, engine, request_id: str) -> None:
    """Wait for the client to leave (``http.disconnect``) and abort its engine request then."""
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            engine.abort(request_id)
            return


def build_app(service: EngineService, api_key: str | None = None, max_request_bytes: int = 4 << 20):
    """The ASGI app answering the OpenAI endpoints with ``service``, behind :class:`~.gate.RequestGate`
    (``api_key``: None leaves the server open; ``max_request_bytes``: the largest body read)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from hybridflow.serve.gate import RequestGate

    app = FastAPI(title="hybridflow.serve")

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException):
        # FastAPI's own refusals (a body it cannot parse, a wrong method or path) in OpenAI's shape
        kind = "NotFoundError" if error.status_code == 404 else "invalid_request_error"
        body = APIError(error.status_code, str(error.detail), kind=kind).body()
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

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
        """hybridflow's own: the engine's counters (prefill tokens, decode steps, generated tokens,
        aborted and failed requests), the requests running and waiting now, and ``in_flight``: the
        sequences admitted and not yet answered (what ``--max-waiting`` bounds, with the cache slots)."""
        engine = service.engine
        running, waiting = engine.num_running, engine.num_waiting
        return {**engine.stats, "running": running, "waiting": waiting, "in_flight": service.in_flight}

    @app.get("/v1/models")
    async def models():
        card = {"id": service.model_name, "object": "model", "created": now(), "owned_by": "hybridflow"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest, http_request: Request):
        if request.stream:
            request_id, events, admission = await service.chat_stream(request)
            watcher = asyncio.ensure_future(_abort_on_disconnect(http_request, service.engine, request_id))
            return StreamingResponse(_until_done(events, watcher, admission), media_type="text/event-stream")
        return await _watched(service.chat(request), http_request, service.engine)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http_request: Request):
        if request.stream:
            raise APIError(
                400, "streaming is served for /v1/chat/completions; set stream=false here", param="stream"
            )
        return await _watched(service.completions(request), http_request, service.engine)

    from hybridflow.serve.scoring import add_scoring_routes

    add_scoring_routes(app, service)  # the teacher's /v1/score (on-policy distillation)
    from hybridflow.serve.sleep import add_sleep_routes

    add_sleep_routes(app, service)  # /sleep, /wake_up, /is_sleeping (a colocated reward model)
    from hybridflow.serve.metrics import add_metrics_route

    add_metrics_route(app, service)  # /metrics: Prometheus text, vLLM's names
    return RequestGate(app, api_key, max_request_bytes)


async def _watched(call, http_request, engine):
    """Run an endpoint's ``call``, cancelled (its engine requests aborted) if the client leaves first."""
    task = asyncio.ensure_future(call)

    async def left() -> None:
        while (await http_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(left())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():  # the client is gone: nobody reads the answer
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        from fastapi.responses import Response

        return Response(status_code=499)
    return task.result()


async def _until_done(events, watcher, admission):
    """Stream ``events``; once they end (or the stream is dropped) stop watching for a disconnect and
    give the request's place back."""
    try:
        async for event in events:
            yield event
    finally:
        watcher.cancel()
        admission.__exit__(None, None, None)
        await events.aclose()
