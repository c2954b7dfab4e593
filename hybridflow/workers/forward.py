"""The one model forward the actor, reference and critic share.

A row is ``[prompt (T_p, left-padded) | response (T_r, right-padded)]``. A response token at index t is
predicted by the model output at the position before it, so the outputs for the response are the
``T_r`` positions that end one before the last column.

Padding is trimmed per micro-batch before the forward: the leading columns that no row attends to
(prompt padding) and the trailing ones (response padding) are cut, so a micro-batch of short answers
does not pay for ``max_prompt_length + max_response_length``. This is exact: the cut columns are
masked out of every attention row (leading) or come after every attended token (trailing, causal),
and ``position_ids`` travel with their columns. verl reaches the same end with ``use_remove_padding``
(packed sequences and flash-attention varlen); trimming needs no special kernel, so it is always on.
Causal LMs that take ``logits_to_keep`` (Hugging Face Llama, Qwen2, ...) also skip the vocabulary
projection of the prompt positions.

With the CPU attention (:mod:`hybridflow.models.attention`) the micro-batch goes further: packed into
one row of its real tokens, each shared prompt once (:mod:`hybridflow.workers.packed_rows`). Other
attention implementations pack shared prompts with a dense block mask when that saves FLOPs
(:mod:`hybridflow.workers.shared_prefix`). Every layout gives the padded layout's outputs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridflow import keys
from hybridflow.models.attention import CPU_ATTENTION
from hybridflow.protocol import DataProto
from hybridflow.workers.lora import unwrap_peft
from hybridflow.workers.packed_rows import gather_packed_outputs, plan_packed_rows
from hybridflow.workers.router_replay import prepare_forward
from hybridflow.workers.shared_prefix import PackedBatch, gather_response_outputs, plan_packing
from hybridflow.workers.vision_forward import has_images, vision_response_outputs


@dataclass
class ForwardTally:
    """What the forwards inside :func:`tally_forwards` computed, for their FLOPs: ``rows``, every row's
    real tokens; ``repeated_prompts``, the prompt lengths the shared-prompt layouts computed once for a
    group instead of once per row (:func:`~hybridflow.workers.shared_prefix.repeated_prompts`). The
    forwards' FLOPs are those of ``rows`` less those of ``repeated_prompts``."""

    rows: list[int] = field(default_factory=list)
    repeated_prompts: list[int] = field(default_factory=list)


_OPEN_TALLIES: list[ForwardTally] = []


@contextlib.contextmanager
def tally_forwards():
    """Within it, every :func:`response_outputs` call adds its rows to the tally it yields."""
    tally = ForwardTally()
    _OPEN_TALLIES.append(tally)
    try:
        yield tally
    finally:
        _OPEN_TALLIES.remove(tally)


def tally_rows(micro: DataProto, repeated: list[int]) -> None:
    """Add ``micro``'s rows and the prompt lengths its layout computed once per group (``repeated``) to
    the open tallies (none open: nothing)."""
    if _OPEN_TALLIES:
        rows = micro.batch[keys.ATTENTION_MASK].sum(-1).tolist()
        for tally in _OPEN_TALLIES:
            tally.rows.extend(rows)
            tally.repeated_prompts.extend(repeated)


def attended_span(attention_mask: torch.Tensor, prompt_len: int) -> tuple[int, int]:
    """``(first, end)``: the column range ``[first, end)`` of ``attention_mask`` (b, T) that holds every
    attended token, with ``first <= prompt_len - 1`` and ``end >= prompt_len + 1`` so that at least one
    prompt position and one response column stay (a batch of empty responses keeps its shapes)."""
    attended = torch.nonzero(attention_mask.any(dim=0)).flatten()
    if attended.numel() == 0:
        return prompt_len - 1, prompt_len + 1
    first = min(int(attended[0]), prompt_len - 1)
    end = max(int(attended[-1]) + 1, prompt_len + 1)
    return first, end


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def response_outputs(model: nn.Module, micro: DataProto) -> torch.Tensor:
    """Model outputs at the positions that predict the kept response tokens: ``(b, T_k, C)`` in fp32,
    ``T_k <= T_r`` (the response columns before the trimmed trailing padding; C = vocabulary for a
    causal LM, 1 for a value head). Response column t of the batch is column t of the output.

    Rows that share a prompt (GRPO's ``n`` responses) are computed packed, the prompt once per group,
    when that costs fewer FLOPs; the outputs are the same. With the CPU attention the packed rows of
    :mod:`hybridflow.workers.packed_rows` (no padding at all); otherwise the block mask of
    :mod:`hybridflow.workers.shared_prefix`. When packed rows would not save 5% of the positions, the
    block mask (which computes at least as many) would not either, so it is not planned."""
    prompt_len = micro.batch[keys.INPUT_IDS].shape[1] - micro.batch[keys.RESPONSES].shape[1]
    first, end = attended_span(micro.batch[keys.ATTENTION_MASK], prompt_len)
    if has_images(micro):  # image rows: M-RoPE positions, images encoded in the forward (padded layout)
        tally_rows(micro, [])
        return vision_response_outputs(model, micro, first, end, prompt_len)
    config = unwrap_peft(model).config
    if getattr(config, "_attn_implementation", None) == CPU_ATTENTION:
        rows = plan_packed_rows(micro, end - first)
        if rows is not None:
            tally_rows(micro, rows.repeated_prompts)
            prepare_forward(model, micro, rows.input_ids, rows)  # router replay's ids (no-op when off)
            logits = _logits(
                model, rows.input_ids, rows.attention_mask, rows.position_ids, rows.kept_positions
            )
            return gather_packed_outputs(logits, rows, at_kept=_takes_logits_to_keep_of(model)).float()
    else:
        packed = plan_packing(micro, config, end - first)
        if packed is not None:
            tally_rows(micro, packed.repeated_prompts)
            prepare_forward(model, micro, packed.input_ids, packed)
            return _packed_outputs(model, packed)
    tally_rows(micro, [])
    kept_response_len = end - prompt_len
    prepare_forward(model, micro, micro.batch[keys.INPUT_IDS][:, first:end], (first, end))
    logits = _logits(
        model,
        micro.batch[keys.INPUT_IDS][:, first:end],
        micro.batch[keys.ATTENTION_MASK][:, first:end],
        micro.batch[keys.POSITION_IDS][:, first:end],
        kept_response_len + 1,
    )
    return logits[:, -kept_response_len - 1 : -1, :].float()


def _takes_logits_to_keep_of(model: nn.Module) -> bool:
    return _takes_logits_to_keep(type(unwrap_peft(model)))


def _logits(model: nn.Module, input_ids, attention_mask, position_ids, logits_to_keep) -> torch.Tensor:
    """The model's output logits; only at ``logits_to_keep`` (the last k positions, or the given
    positions) where the model takes that argument, else at every position."""
    extra = {"logits_to_keep": logits_to_keep} if _takes_logits_to_keep_of(model) else {}
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **extra,
    )
    return output.logits


def _packed_outputs(model: nn.Module, packed: PackedBatch) -> torch.Tensor:
    """``(b, T_k, C)`` outputs of the block-mask packed forward, gathered back to the rows."""
    width = packed.input_ids.shape[1]
    # Outputs are needed from the earliest prompt end on (the positions before predict nothing).
    first_kept = int(packed.index[packed.valid].min()) if bool(packed.valid.any()) else width - 1
    if not _takes_logits_to_keep_of(model):
        first_kept = 0
    logits = _logits(model, packed.input_ids, packed.attention_mask, packed.position_ids, width - first_kept)
    return gather_response_outputs(logits, packed, first_kept).float()


def pad_responses(values: torch.Tensor, response_len: int) -> torch.Tensor:
    """Widen per-token ``values`` (b, T_k) to (b, T_r) with zeros in the trimmed padding columns."""
    missing = response_len - values.shape[1]
    return torch.nn.functional.pad(values, (0, missing)) if missing else values
