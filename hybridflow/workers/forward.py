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

import functools
import inspect

import torch
from torch import nn

from hybridflow import keys
from hybridflow.models.attention import CPU_ATTENTION
from hybridflow.protocol import DataProto
from hybridflow.workers.lora import unwrap_peft
from hybridflow.workers.packed_rows import PackedInputs, gather_packed_outputs, plan_packed_rows
from hybridflow.workers.shared_prefix import PackedBatch, gather_response_outputs, plan_packing


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
    when that costs fewer FLOPs (:mod:`hybridflow.workers.shared_prefix`); the outputs are the same."""
    prompt_len = micro.batch[keys.INPUT_IDS].shape[1] - micro.batch[keys.RESPONSES].shape[1]
    first, end = attended_span(micro.batch[keys.ATTENTION_MASK], prompt_len)
    config = unwrap_peft(model).config
    if getattr(config, "_attn_implementation", None) == CPU_ATTENTION:
        packed_rows = plan_packed_rows(micro, end - first)
        if packed_rows is not None:
            return _packed_rows_outputs(model, packed_rows)
    packed = plan_packing(micro, config, end - first)
    if packed is not None:
        return _packed_outputs(model, packed)
    kept_response_len = end - prompt_len
    extra = {}
    if _takes_logits_to_keep(type(unwrap_peft(model))):
        extra["logits_to_keep"] = kept_response_len + 1
    output = model(
        input_ids=micro.batch[keys.INPUT_IDS][:, first:end],
        attention_mask=micro.batch[keys.ATTENTION_MASK][:, first:end],
        position_ids=micro.batch[keys.POSITION_IDS][:, first:end],
        use_cache=False,
        **extra,
    )
    return output.logits[:, -kept_response_len - 1 : -1, :].float()


def _packed_rows_outputs(model: nn.Module, packed: PackedInputs) -> torch.Tensor:
    """``(b, T_k, C)`` outputs of the padding-free forward, gathered back to the rows."""
    takes_logits_to_keep = _takes_logits_to_keep(type(unwrap_peft(model)))
    extra = {"logits_to_keep": packed.kept_positions} if takes_logits_to_keep else {}
    output = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        use_cache=False,
        **extra,
    )
    return gather_packed_outputs(output.logits, packed, at_kept=takes_logits_to_keep).float()


def _packed_outputs(model: nn.Module, packed: PackedBatch) -> torch.Tensor:
    """``(b, T_k, C)`` outputs of the packed forward, gathered back to the rows."""
    width = packed.input_ids.shape[1]
    # Outputs are needed from the earliest prompt end on (the positions before predict nothing).
    first_kept = int(packed.index[packed.valid].min()) if bool(packed.valid.any()) else width - 1
    extra = {}
    if _takes_logits_to_keep(type(unwrap_peft(model))):
        extra["logits_to_keep"] = width - first_kept
    else:
        first_kept = 0
    output = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        use_cache=False,
        **extra,
    )
    return gather_response_outputs(output.logits, packed, first_kept).float()


def pad_responses(values: torch.Tensor, response_len: int) -> torch.Tensor:
    """Widen per-token ``values`` (b, T_k) to (b, T_r) with zeros in the trimmed padding columns."""
    missing = response_len - values.shape[1]
    return torch.nn.functional.pad(values, (0, missing)) if missing else values
