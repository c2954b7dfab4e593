"""The rollout interface and its name registry (``actor_rollout_ref.rollout.name``).

A rollout turns a batch of left-padded prompts into prompts + responses. Input keys: ``input_ids``,
``attention_mask``, ``position_ids`` (B, T_p); meta_info ``eos_token_id`` (int or list),
``pad_token_id``, ``do_sample``, ``validate`` (use ``val_kwargs``), ``global_steps``. Output keys:
``prompts`` (B, T_p), ``responses`` (B, T_r) right-padded with pad ids after EOS, ``response_mask``
(B, T_r), ``input_ids``/``attention_mask``/``position_ids`` (B, T_p + T_r), and ``rollout_log_probs``
(B, T_r) when the engine reports them. Responses are exactly ``rollout.response_length`` wide. The
sampling temperature is not reported: training log-probs use ``rollout.temperature`` from config only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.utils.registry import Registry
from hybridflow.utils.torch_functional import get_response_mask

ROLLOUTS: Registry = Registry("rollout")


def register_rollout(name: str, *aliases: str):
    """Class decorator: make a rollout selectable as ``actor_rollout_ref.rollout.name=<name>``."""
    return ROLLOUTS.register(name, *aliases)


def get_rollout_cls(name: str) -> type[BaseRollout]:
    return ROLLOUTS.get(name)


class BaseRollout(ABC):
    """Generates responses for a batch of prompts."""

    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """See the module docstring for the keys in and out."""

    def update_weights(self) -> dict[str, float]:
        """Refresh the rollout's weights from the actor after an update (a collective: every rank
        calls it). Returns metrics (``update_weights`` seconds, ...). No-op for rollouts that run on
        the actor's own module."""
        return {}

    def release(self) -> None:  # noqa: B027 (optional hook)
        """Free generation-only memory (KV cache) between phases. No-op by default."""

    @property
    def weights_loaded(self) -> bool:
        """False after :meth:`release_weights`: the next :meth:`update_weights` must refill them."""
        return True

    def release_weights(self) -> None:  # noqa: B027 (optional hook)
        """Free a generation-only copy of the weights between rollouts. No-op by default (a rollout
        that runs on the actor's own module has none)."""

    def resume(self, rows: int | None = None) -> None:  # noqa: B027 (optional hook)
        """Re-create what :meth:`release` freed (``rows``: the most sequences that will run at once,
        when the caller knows; None: the configured size). No-op by default."""


def generation_seed(base_seed: int, step: int, rank: int) -> int:
    """Seed for one generate call: a function of (seed, step, rank) only, so a resumed run samples
    exactly what an uninterrupted one would."""
    return (int(base_seed) * 1_000_003 + int(step) * 7_919 + int(rank)) % (2**31 - 1)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(base_seed: int, epoch: int, index: int, validate: bool = False) -> int:
    """The seed of one prompt's sampling streams: a function of (``rollout.seed``, the epoch, the
    prompt's dataset index) only. Its k-th sample draws from stream (seed, k) (``SamplingParams.seed``
    and ``seed_sample``) — never from anything of the batch it shares, the rank or replica it lands on,
    or the step — so a sample draws the same tokens whichever way the batch is split, served or resumed.
    Validation draws from streams of its own."""
    x = int(base_seed) & _MASK64
    for value in (int(epoch), int(index), int(bool(validate))):
        x = _splitmix64(x ^ _splitmix64(value & _MASK64))
    return x & 0x7FFFFFFF


def sampling_params(config, meta_info: dict) -> dict:
    """Effective sampling settings: ``val_kwargs`` when validating, greedy when ``do_sample`` is off."""
    source = config.val_kwargs if meta_info.get("validate", False) else config
    do_sample = bool(meta_info.get("do_sample", source.get("do_sample", True)))
    temperature = float(source.get("temperature", 1.0))
    if not do_sample or temperature == 0:
        return {"do_sample": False, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
    return {
        "do_sample": True,
        "temperature": temperature,
        "top_p": float(source.get("top_p", 1.0)),
        "top_k": int(source.get("top_k", -1)),
    }


def assemble_output(
    prompts: DataProto,
    responses: torch.Tensor,
    eos_ids: list[int],
    pad_id: int,
    rollout_log_probs: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    response_attention: torch.Tensor | None = None,
) -> DataProto:
    """Build the standard rollout output from left-padded prompts and raw generated ids (B, T_r).

    By default tokens after the first EOS become ``pad_id`` and ``response_mask`` is 1 up to and
    including it. Multi-turn rollouts pass their own ``response_mask`` (1 on generated tokens only)
    and ``response_attention`` (1 on every response token, tool turns too), both (B, T_r), with
    ``responses`` already padded. Positions continue from each prompt's last position."""
    prompt_ids = prompts.batch[keys.INPUT_IDS]
    prompt_mask = prompts.batch[keys.ATTENTION_MASK]
    prompt_pos = prompts.batch[keys.POSITION_IDS]
    device = prompt_ids.device  # generated rows may be built on the host: the output lives with the prompts
    responses = responses.to(device)
    response_mask = None if response_mask is None else response_mask.to(device)
    response_attention = None if response_attention is None else response_attention.to(device)
    rollout_log_probs = None if rollout_log_probs is None else rollout_log_probs.to(device)
    if response_mask is None:
        response_mask = get_response_mask(responses, eos_ids, dtype=prompt_mask.dtype)
        responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_id))
    response_mask = response_mask.to(prompt_mask.dtype)
    if response_attention is None:
        response_attention = response_mask
    steps = torch.arange(1, responses.shape[1] + 1, dtype=prompt_pos.dtype, device=device).unsqueeze(0)
    tensors = {
        keys.PROMPTS: prompt_ids,
        keys.RESPONSES: responses,
        keys.RESPONSE_MASK: response_mask,
        keys.INPUT_IDS: torch.cat([prompt_ids, responses], dim=1),
        keys.ATTENTION_MASK: torch.cat([prompt_mask, response_attention.to(prompt_mask.dtype)], dim=1),
        keys.POSITION_IDS: torch.cat([prompt_pos, prompt_pos[:, -1:] + steps], dim=1),
    }
    if rollout_log_probs is not None:
        tensors[keys.ROLLOUT_LOG_PROBS] = rollout_log_probs * response_mask
    return DataProto.from_dict(tensors, meta_info={})


def completions_output(
    prompts: DataProto,
    completions: list,
    response_length: int,
    pad_id: int,
    with_log_probs: bool,
) -> DataProto:
    """The standard output (:func:`assemble_output`) for one completion per prompt row, in row order:
    each completion's ``token_ids`` and ``log_probs`` (lists) fill a ``response_length``-wide row. Rows
    are built on the host from the engine's token lists; :func:`assemble_output` moves them once.

    ``response_mask`` is 1 on each completion's own tokens: the engine stops after the first stop token
    (EOS included), so this is the EOS-cut mask, and with ``rollout.ignore_eos`` it keeps the tokens
    generated past an EOS (the whole set length, as verl's agent-loop rollout counts them)."""
    responses = torch.full((len(completions), response_length), pad_id, dtype=torch.long)
    log_probs = torch.zeros(len(completions), response_length, dtype=torch.float32)
    lengths = torch.zeros(len(completions), dtype=torch.long)
    for row, completion in enumerate(completions):
        tokens = completion.token_ids[:response_length]
        lengths[row] = len(tokens)
        responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        log_probs[row, : len(tokens)] = torch.tensor(completion.log_probs[:response_length])
    response_mask = (torch.arange(response_length)[None, :] < lengths[:, None]).to(torch.int64)
    return assemble_output(
        prompts, responses, [], pad_id, log_probs if with_log_probs else None, response_mask=response_mask
    )
