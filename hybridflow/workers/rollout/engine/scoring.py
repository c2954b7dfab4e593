"""Scoring without generating: the top-k log-probs at every position of given token ids.

A teacher for on-policy distillation reads the student's prompt + response and returns, at each response
position, the k most likely next tokens under the teacher with their log-probs (vLLM's
``prompt_logprobs``). No token is generated and no KV cache slot is taken: one causal forward over each
whole sequence, the same layer ops as the engine's prefill (:meth:`EngineModel.prefill`), with the
vocabulary projection made only at the positions asked for, a few at a time.

Shapes: P sequences in a call, T the longest, H hidden size, V vocabulary, k the top-k width, N_i the
positions scored in sequence i (``len(ids_i) - start_i``).

Position convention: position t (``start <= t < len(ids)``) is scored by the distribution that predicts
``ids[t]`` from ``ids[:t]``, i.e. the model output at t - 1; so ``start`` is at least 1 (the prompt
length, for a response). The returned ``token_log_probs`` are the log-probs of ``ids[t]`` itself.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hybridflow.workers.rollout.engine.model import EngineModel

# positions projected to the vocabulary at once: (chunk, V) fp32 logits (49k vocabulary: ~50 MB)
LOGIT_CHUNK = 256


@dataclass
class ScoredSequence:
    """One sequence's scores: ``top_log_probs`` (N, k) fp32 descending, ``top_ids`` (N, k) int64,
    ``token_log_probs`` (N,) fp32 — row j is position ``start + j``."""

    top_log_probs: torch.Tensor
    top_ids: torch.Tensor
    token_log_probs: torch.Tensor


def check_scoring_request(ids: list[int], start: int, k: int, vocab: int, max_len: int) -> None:
    """``ValueError`` naming what is wrong with one sequence to score."""
    if not ids:
        raise ValueError("empty sequence: nothing to score")
    if not 1 <= start < len(ids) + 1:
        raise ValueError(f"start={start} must be in [1, {len(ids)}] (the first scored position)")
    if not 1 <= k <= vocab:
        raise ValueError(f"top-k={k} must be in [1, {vocab}] (the vocabulary size)")
    if len(ids) > max_len:
        raise ValueError(f"sequence of {len(ids)} tokens is longer than max_model_len={max_len}")
    outside = next((t for t in ids if not 0 <= t < vocab), None)
    if outside is not None:
        raise ValueError(f"token id {outside} is outside the model's vocabulary [0, {vocab})")


@torch.no_grad()
def hidden_states(model: EngineModel, tokens: torch.Tensor) -> torch.Tensor:
    """The final-norm hidden states (P, T, H) of right-padded ``tokens`` (P, T): the engine's prefill
    forward without writing a cache (right padding never reaches a real position under the causal mask;
    :meth:`EngineModel.hidden_states`)."""
    return model.hidden_states(tokens)


@torch.no_grad()
def score_sequences(
    model: EngineModel, sequences: list[list[int]], starts: list[int], k: int, temperature: float = 1.0
) -> list[ScoredSequence]:
    """Top-``k`` log-probs (of ``log_softmax(logits / temperature)``) at positions ``starts[i]`` ..
    ``len(sequences[i]) - 1`` of each sequence (see the module docstring); one forward for all."""
    lengths = [len(s) for s in sequences]
    tokens = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
    for row, ids in enumerate(sequences):
        tokens[row, : lengths[row]] = torch.tensor(ids, dtype=torch.long)
    tokens = tokens.to(model.device)
    hidden = hidden_states(model, tokens)
    scored = []
    for row, (length, start) in enumerate(zip(lengths, starts, strict=True)):
        tops, ids, own = [], [], []
        for first in range(start, length, LOGIT_CHUNK):
            end = min(first + LOGIT_CHUNK, length)
            logits = model._logits(hidden[row, first - 1 : end - 1])  # (n, V) fp32, predicting first..end-1
            log_probs = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
            values, indices = log_probs.topk(k, dim=-1)
            tops.append(values)
            ids.append(indices)
            own.append(log_probs.gather(-1, tokens[row, first:end].unsqueeze(-1)).squeeze(-1))
        empty = torch.empty(0, k)
        scored.append(
            ScoredSequence(
                top_log_probs=torch.cat(tops).float().cpu() if tops else empty,
                top_ids=torch.cat(ids).cpu() if ids else empty.long(),
                token_log_probs=torch.cat(own).float().cpu() if own else torch.empty(0),
            )
        )
    return scored


async def score_in_engine(engine, sequences: list[list[int]], starts: list[int], k: int, temperature: float):
    """:meth:`LLMEngine.score`: the requests checked, then :func:`score_sequences` on the engine's model;
    with ``step_in_thread`` in the engine's step thread, so scoring never runs during a step and the
    event loop keeps answering."""
    vision = engine.model.vision
    for i, (ids, start) in enumerate(zip(sequences, starts, strict=True)):
        check_scoring_request(ids, start, k, engine.model.full_spec.vocab_size, engine.max_model_len)
        if vision is not None and vision.image_token_id in ids:
            raise ValueError(
                f"sequence {i} holds image tokens: scoring takes no images (the engine scores text only)"
            )
    if not engine.step_in_thread:
        return score_sequences(engine.model, sequences, starts, k, temperature)
    if engine._executor is None:
        engine._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
    run = lambda: score_sequences(engine.model, sequences, starts, k, temperature)  # noqa: E731
    return await asyncio.get_running_loop().run_in_executor(engine._executor, run)
