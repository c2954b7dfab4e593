"""What the engine keeps per request and per running sample, and what it hands back.

A request (:class:`EngineRequest`) asks for ``n`` samples of one prompt; each runs as a
:class:`RunningSequence` over its own block table of the paged KV cache (the prompt's full blocks
shared by the samples) until it stops, and becomes a :class:`Completion`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from hybridflow.workers.rollout.engine.routing import RoutingRecord
from hybridflow.workers.rollout.engine.sampling import SamplingParams


@dataclass
class Completion:
    """One sampled continuation: ``token_ids`` include the stop token when ``finish_reason == "stop"``.
    ``top_log_probs``: per token, the ``SamplingParams.logprobs`` most likely (token, log-prob) pairs
    under the distribution it was drawn from (None when not asked for)."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    top_log_probs: list[list[tuple[int, float]]] | None = None
    # router replay (R3, .routing): (prompt + response tokens, L sparse layers, k) expert ids, or None
    routed_experts: torch.Tensor | None = None


class EngineRequestError(RuntimeError):
    """One request failed inside the engine (its prefill, logits processor or stop checker raised);
    the other requests of the batch were not affected."""


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    error: str | None = None  # why the request failed inside the engine (its completions end "error")


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    stop_ids: frozenset[int]
    max_new_tokens: int
    completions: list[Completion | None] = field(default_factory=list)
    future: asyncio.Future | None = None
    # stream(): (sample, token, log-prob, top alternatives or None) per token, then the result
    listener: asyncio.Queue | None = None
    error: BaseException | None = None
    # a vision-language prompt's images: pixel_values (patches, D), image_grid_thw (n, 3) (.vision)
    images: dict | None = None
    image_digest: bytes = b""  # the images' contents, in every prefix key of the prompt (.block_pool)

    @property
    def done(self) -> bool:
        return all(c is not None for c in self.completions)

    def result(self) -> GenerationResult:
        error = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        return GenerationResult(self.request_id, self.prompt_ids, list(self.completions), error)


@dataclass
class RunningSequence:
    """One running sample. ``length`` positions are in its blocks (``blocks``: its block table);
    ``pending`` is the next token to feed. ``keys``: the prefix keys of its first ``len(keys)`` full
    blocks (:mod:`.block_pool`); ``cacheable``: its blocks may be keyed (False once the weights changed
    under it: its keys and values mix two versions)."""

    request: EngineRequest
    index: int
    length: int
    pending: int = -1
    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    cacheable: bool = True
    rope_delta: int = 0  # rotary position - cache position of its next tokens (image prompts: <= 0)
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)
    routing: RoutingRecord | None = None  # the expert ids per position, when the engine records them


def cached_tokens(seq: RunningSequence) -> list[int]:
    """The tokens whose keys and values ``seq`` holds or recomputes: its prompt and every generated
    token but the pending one (``length`` of them while it runs)."""
    return seq.request.prompt_ids + seq.token_ids[:-1] if seq.token_ids else list(seq.request.prompt_ids)


def finished_completion(seq: RunningSequence, reason: str) -> Completion:
    tops = seq.top_log_probs if seq.request.params.logprobs > 0 else None
    routed = None
    if seq.routing is not None:
        routed = seq.routing.upto(len(seq.request.prompt_ids) + len(seq.token_ids))
    return Completion(seq.token_ids, seq.log_probs, reason, tops, routed)


def raise_failed(requests: list[EngineRequest]) -> None:
    """Raise :class:`EngineRequestError` for the first of ``requests`` that failed in the engine (the
    synchronous callers' view: a rollout cannot go on without a sample)."""
    for request in requests:
        if request.error is not None:
            raise EngineRequestError(
                f"request {request.request_id} failed in the engine: {request.error!r}"
            ) from request.error


def settle(future: asyncio.Future, result: GenerationResult) -> None:
    """Resolve an awaiting ``generate`` call's future with ``result`` (its error raised as
    :class:`EngineRequestError`); a future already done (cancelled) is left alone."""
    if future.done():
        return
    if result.error is not None:
        future.set_exception(EngineRequestError(result.error))
    else:
        future.set_result(result)


def stream_keys(seqs: list[RunningSequence]) -> list[tuple[int, int, int]]:
    """Each sequence's seeded draw key (seed, sample index, next stream position) (see
    :func:`~.sampling.seeded_uniforms`); (0, 0, 0) for a sequence without a seed."""
    keys = []
    for seq in seqs:
        params = seq.request.params
        if params.seed is None:
            keys.append((0, 0, 0))
        else:
            keys.append(
                (params.seed, params.seed_sample + seq.index, params.seed_position + len(seq.token_ids))
            )
    return keys


def top_alternatives(seqs: list[RunningSequence], logits: torch.Tensor) -> dict[int, list[tuple[int, float]]]:
    """Row -> the ``params.logprobs`` most likely (token, log-prob) pairs of the distribution the row
    samples from (its temperature; untempered when greedy), for the rows that ask. logits (B, V)."""
    found: dict[int, list[tuple[int, float]]] = {}
    for row, seq in enumerate(seqs):
        params = seq.request.params
        if params.logprobs <= 0:
            continue
        scale = params.temperature if not params.greedy and params.temperature != 1.0 else 1.0
        log_probs = torch.log_softmax(logits[row].float() / scale, dim=-1)
        values, indices = torch.topk(log_probs, min(params.logprobs, log_probs.shape[-1]))
        found[row] = list(zip(indices.tolist(), values.tolist(), strict=True))
    return found
