"""The teacher's endpoints: score given token ids without generating (hybridflow's own API).

- ``POST /v1/score/vocab`` (body ``{"model"}`` or ``{}``) → ``{"model", "vocab_size", "tokenizer":
  "sha256:..."}``: what a student checks before training (:mod:`hybridflow.utils.vocab_fingerprint`):
  the same vocabulary size *and* the same ``token -> id`` map, else distillation is refused.
- ``POST /v1/score`` with ``{"model", "prompts": [[ids]], "responses": [[ids]], "top_k": k,
  "temperature": 1.0}`` → ``{"data": [{"index", "top_logprobs" (N_i, k), "top_ids" (N_i, k),
  "token_logprobs" (N_i,)}]}``: for every response token, the teacher's k most likely tokens (ids and
  log-probs, descending) given the prompt and the response before it, and the log-prob of the response
  token itself (vLLM's ``prompt_logprobs`` over the response). Nothing is generated; no cache slot is
  held. An empty response scores to empty lists.

Bad requests get the server's OpenAI-style errors: an unknown model 404, token ids outside the
vocabulary, an empty prompt, ``top_k`` outside ``[1, min(vocab, MAX_TOP_K)]``, more sequences than
``--max-prompts`` or a sequence longer than the model (400, naming the sequence), a full server 503 with
``Retry-After`` (the same admission as generation), a wrong API key 401 (:mod:`.gate`).
"""

# no `from __future__ import annotations`: FastAPI reads the endpoint's annotations at build time
from pydantic import BaseModel, ConfigDict, Field

from hybridflow.serve.protocol import APIError

MAX_TOP_K = 1024  # log-probs per position at most (the chat API's top_logprobs stops at 20)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the served model
    prompts: list[list[int]] = Field(min_length=1)
    responses: list[list[int]] = Field(min_length=1)
    top_k: int = Field(1, ge=1)
    temperature: float = Field(1.0, gt=0.0, le=100.0)


class VocabRequest(BaseModel):
    model: str | None = None


def check_score_request(service, request: ScoreRequest) -> tuple[list[list[int]], list[int]]:
    """The sequences (prompt + response) and their first scored positions, or an :class:`APIError`."""
    if request.model is not None:
        service.check_model(request.model)
    if len(request.prompts) != len(request.responses):
        raise APIError(
            400,
            f"{len(request.prompts)} prompts and {len(request.responses)} responses: one response per prompt",
            param="responses",
        )
    most = service.limits.max_prompts
    if len(request.prompts) > most:
        raise APIError(
            400, f"{len(request.prompts)} sequences in one request; the most is {most}.", "prompts"
        )
    top = min(service.vocab_size, MAX_TOP_K)
    if request.top_k > top:
        raise APIError(400, f"top_k={request.top_k} is above this server's limit of {top}.", param="top_k")
    max_len = service.engine.max_model_len
    sequences, starts = [], []
    for i, (prompt, response) in enumerate(zip(request.prompts, request.responses, strict=True)):
        service.check_tokens(prompt, f"prompts[{i}]")
        if response:
            service.check_tokens(response, f"responses[{i}]")
        if len(prompt) + len(response) > max_len:
            raise APIError(
                400,
                f"sequence {i} has {len(prompt) + len(response)} tokens; this model's maximum context "
                f"length is {max_len}.",
                param=f"responses[{i}]",
            )
        sequences.append(list(prompt) + list(response))
        starts.append(len(prompt))
    return sequences, starts


async def score(service, request: ScoreRequest) -> dict:
    sequences, starts = check_score_request(service, request)
    scored_rows = [i for i, (s, start) in enumerate(zip(sequences, starts, strict=True)) if start < len(s)]
    with service.admitted(len(sequences)):
        try:
            scored = (
                await service.engine.score(
                    [sequences[i] for i in scored_rows],
                    [starts[i] for i in scored_rows],
                    request.top_k,
                    request.temperature,
                )
                if scored_rows
                else []
            )
        except ValueError as error:
            raise APIError(400, str(error)) from error
    by_row = dict(zip(scored_rows, scored, strict=True))
    data = []
    for i in range(len(sequences)):
        row = by_row.get(i)
        data.append(
            {
                "index": i,
                "top_logprobs": row.top_log_probs.tolist() if row else [],
                "top_ids": row.top_ids.tolist() if row else [],
                "token_logprobs": row.token_log_probs.tolist() if row else [],
            }
        )
    return {"object": "scores", "model": service.model_name, "vocab_size": service.vocab_size, "data": data}


def add_scoring_routes(app, service) -> None:
    """``/v1/score`` and ``/v1/score/vocab`` (both POST: the JSON client's one verb) on ``app`` (a FastAPI
    app), answered by ``service``."""
    from hybridflow.utils.vocab_fingerprint import vocab_fingerprint

    fingerprint = vocab_fingerprint(service.tokenizer)

    @app.post("/v1/score/vocab")
    async def vocab(request: VocabRequest):
        if request.model is not None:
            service.check_model(request.model)
        return {"model": service.model_name, "vocab_size": service.vocab_size, "tokenizer": fingerprint}

    @app.post("/v1/score")
    async def score_endpoint(request: ScoreRequest):
        return await score(service, request)
