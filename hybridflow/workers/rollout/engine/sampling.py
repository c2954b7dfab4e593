"""Sampling parameters and the per-step token choice.

Log-probs reported for a sampled token are ``log_softmax(logits / temperature)`` over the full
vocabulary — the quantity the actor recomputes as ``old_log_probs`` (top-k/top-p only restrict which
tokens can be drawn). Greedy rows report ``log_softmax(logits)``.

**Seeded samples.** A request with ``SamplingParams.seed`` draws its i-th sample's token at response
position t from a uniform that is a hash of (seed, seed_sample + i, seed_position + t) alone
(:func:`seeded_uniforms`): counter-based,
so what a sample draws never depends on which other requests share the batch, on the order they
arrived, or on how many steps ran before — and a sample resumed at position t (``seed_position``)
continues the stream it would have drawn uninterrupted. Unseeded requests use the engine's generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature=0`` (or ``do_sample=False``) is greedy; ``top_k<=0`` and ``top_p>=1`` are off."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # (this sequence's generated ids, its logits (V,)) -> logits: constrains or scripts generation;
    # reported log-probs are then those of the processed logits
    logits_processor: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None
    # also report this many most likely (token, log-prob) alternatives per generated token
    logprobs: int = 0
    # (this sequence's generated ids) -> True to end it at its latest token, finish_reason "stop"
    # (the server's stop strings: decoding ends where the text first contains one)
    stop_checker: Callable[[list[int]], bool] | None = None
    # seeded sampling streams (module docstring): sample i draws from stream (seed, seed_sample + i),
    # starting at position seed_position (a resumed sample's); seed None: the engine's generator
    seed: int | None = None
    seed_sample: int = 0
    seed_position: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def choice_key(self) -> tuple:
        """Rows with equal keys are sampled together in one vectorised call."""
        return (self.greedy, self.temperature, self.top_k, self.top_p, id(self.logits_processor))


def choose_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) fp32 → (tokens (B,), log-probs (B,)) for rows that share ``params``.
    ``uniforms`` (B,) in (0, 1]: the rows' draws (seeded samples), else taken from ``generator``."""
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, _token_log_probs(logits, tokens)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    log_probs = torch.log_softmax(scaled, dim=-1)
    if (0 < params.top_k < logits.shape[-1]) or params.top_p < 1.0:
        probs = torch.softmax(_top_k_top_p(scaled, params.top_k, params.top_p), dim=-1)
    else:
        probs = log_probs.exp()
    tokens = sample_from_probs(probs, generator, uniforms)
    return tokens, log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def sample_from_probs(
    probs: torch.Tensor, generator: torch.Generator | None, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """One draw per row by inverting the CDF with a single uniform per row (``probs`` is consumed).

    ``torch.multinomial`` draws an exponential variate per vocabulary entry (B x V random numbers,
    ~200 ms per step at B=256, V=32k on one core); this needs B. ``u`` lies in (0, 1], so a token
    of zero probability (filtered out) can never be chosen. ``uniforms`` (B,): given draws."""
    cdf = probs.cumsum_(dim=-1)
    if uniforms is None:
        u = 1.0 - torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device)
    else:
        u = uniforms.to(device=cdf.device, dtype=cdf.dtype).unsqueeze(1)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1)
    return tokens.clamp_(max=cdf.shape[-1] - 1)


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values below 2**32 (each multiplier is below
    2**31, so no product overflows int64)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def seeded_uniforms(seeds: torch.Tensor, samples: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1] (float64, 53 random bits) that depend only on each row's (seed, sample index,
    stream position): int64 tensors (B,). The same triple gives the same number on any device, in any
    batch."""
    key = _mix32((seeds & _MASK32) ^ _mix32(samples & _MASK32))
    key = _mix32(key ^ _mix32((positions & _MASK32) + 0x9E3779B))
    high = _mix32(key ^ 0x2545F49)  # two 32-bit words -> 32 + 21 = 53 random bits
    low = _mix32(key ^ 0x5851F42)
    value = high.double() * 2.0**21 + (low >> 11).double()  # in [0, 2**53)
    return (value + 1.0) / 2.0**53


def _token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (the best token always stays)."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
