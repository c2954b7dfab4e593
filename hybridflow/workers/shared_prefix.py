"""Shared-prompt packing for the actor/reference/critic forward (GRPO's ``n`` responses per prompt).

The ``n`` rows of one prompt repeat the same prompt tokens ``n`` times. Packed, a group is one row
``[prompt | response_1 | ... | response_n]`` with the positions each token had in its own row (every
response restarts at the prompt's length) and a block attention mask: prompt tokens attend causally to
the prompt, a response token to the whole prompt and causally to its own response — never to a sibling.
Every token then sees exactly what it saw in its own row, so outputs (and gradients, which the shared
prompt accumulates from all its responses) are those of the padded layout; the prompt is computed once
instead of ``n`` times. The first response token of every row is predicted by the prompt's last
position, shared by the group.

The mask is dense per packed row (SDPA with a boolean mask does not skip the blocks a causal flag
would), so packing pays when prompts are long relative to responses and loses when the packed rows
get long: :func:`plan_packing` compares the two layouts' FLOPs and packs only when it saves.

Shapes: ``b`` rows, ``G`` groups, ``L`` the longest packed row, ``T_k`` the longest response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow import keys
from hybridflow.models.moe import mlp_width_per_token
from hybridflow.protocol import DataProto

# Pack only when the estimated FLOPs drop by at least this fraction (estimates are rough).
MIN_SAVING = 0.15
# The block mask holds G x L x L booleans: never build one larger than this.
MAX_MASK_ELEMENTS = 64 * 2**20


@dataclass
class PackedBatch:
    """Model inputs of the packed layout and where each row's outputs are in it."""

    input_ids: torch.Tensor  # (G, L) token ids (0 in the padding)
    position_ids: torch.Tensor  # (G, L) each token's position in its own (unpacked) row
    attention_mask: torch.Tensor  # (G, 1, L, L) bool, True = may attend
    group: torch.Tensor  # (b,) packed row of each row
    index: torch.Tensor  # (b, T_k) packed position whose output predicts response token t (0: unused)
    valid: torch.Tensor  # (b, T_k) bool, response token t exists in the row
    repeated_prompts: list[int] = field(default_factory=list)  # see :func:`repeated_prompts`


@dataclass
class Row:
    prompt: tuple[int, ...]
    prompt_pos: list[int]
    response: list[int]
    response_pos: list[int]


def split_rows(micro: DataProto) -> list[Row]:
    input_ids = micro.batch[keys.INPUT_IDS].tolist()
    mask = micro.batch[keys.ATTENTION_MASK].tolist()
    positions = micro.batch[keys.POSITION_IDS].tolist()
    prompt_len = micro.batch[keys.INPUT_IDS].shape[1] - micro.batch[keys.RESPONSES].shape[1]
    rows = []
    for ids, attended, pos in zip(input_ids, mask, positions, strict=True):
        prompt_cols = [c for c in range(prompt_len) if attended[c]]
        response_cols = [c for c in range(prompt_len, len(ids)) if attended[c]]
        # responses are right-padded: every column up to the last attended one belongs to the row
        length = response_cols[-1] - prompt_len + 1 if response_cols else 0
        rows.append(
            Row(
                tuple(ids[c] for c in prompt_cols),
                [pos[c] for c in prompt_cols],
                ids[prompt_len : prompt_len + length],
                pos[prompt_len : prompt_len + length],
            )
        )
    return rows


def prompt_groups(rows: list[Row]) -> list[list[int]]:
    """Row indices sharing a (non-empty) prompt, in first-seen order."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(rows):
        by_prompt.setdefault(row.prompt if row.prompt else (-1 - i,), []).append(i)
    return list(by_prompt.values())


def repeated_prompts(rows: list[Row], groups: list[list[int]]) -> list[int]:
    """The prompt lengths a shared-prompt layout does not compute: a group of ``m`` rows computes its
    prompt once, not ``m`` times, so ``m - 1`` entries of its prompt's length. The layout's FLOPs are
    the rows' FLOPs less those of sequences of these lengths, exactly (dense layers: ``p`` tokens
    fewer per entry; attention: the pairs ``(p + r)^2`` counts per row, less ``p^2`` per entry, is
    ``p^2 + sum(2 p r + r^2)``, the pairs the packed group attends)."""
    return [len(rows[g[0]].prompt) for g in groups for _ in g[1:]]


def _flops(model_config, tokens: int, attended_pairs: float) -> float:
    """Forward FLOPs of ``tokens`` tokens through the decoder's dense layers plus ``attended_pairs``
    (query, key) pairs of attention (per layer: 4 x heads x head_dim FLOPs per pair)."""
    h = int(model_config.hidden_size)
    layers = int(model_config.num_hidden_layers)
    heads = int(model_config.num_attention_heads)
    head_dim = int(getattr(model_config, "head_dim", None) or h // heads)
    kv = int(getattr(model_config, "num_key_value_heads", None) or heads) * head_dim
    inter = mlp_width_per_token(model_config)  # a mixture of experts: the experts a token runs through
    per_token = 2 * layers * (h * (heads * head_dim + 2 * kv) + heads * head_dim * h + 3 * h * inter)
    return per_token * tokens + 4 * layers * heads * head_dim * attended_pairs


def plan_packing(micro: DataProto, model_config, padded_width: int) -> PackedBatch | None:
    """The packed layout of ``micro`` when it costs at least :data:`MIN_SAVING` fewer FLOPs than the
    padded rows of ``padded_width`` columns (causal attention: half the pairs), else None."""
    rows = split_rows(micro)
    groups = prompt_groups(rows)
    if len(groups) == len(rows):  # no prompt is shared: nothing to gain
        return None
    lengths = [len(rows[g[0]].prompt) + sum(len(rows[i].response) for i in g) for g in groups]
    width = max(lengths)
    if len(groups) * width * width > MAX_MASK_ELEMENTS:
        return None
    padded = _flops(model_config, len(rows) * padded_width, len(rows) * padded_width**2 / 2)
    packed = _flops(model_config, len(groups) * width, len(groups) * width**2)
    if packed > (1 - MIN_SAVING) * padded:
        return None
    packed = _build(rows, groups, width, micro.batch[keys.INPUT_IDS].device)
    packed.repeated_prompts = repeated_prompts(rows, groups)
    return packed


def _build(rows: list[Row], groups: list[list[int]], width: int, device: torch.device) -> PackedBatch:
    n_rows, n_groups = len(rows), len(groups)
    longest = max(1, max(len(r.response) for r in rows))
    ids = torch.zeros(n_groups, width, dtype=torch.long)
    pos = torch.zeros(n_groups, width, dtype=torch.long)
    segment = torch.full((n_groups, width), -1, dtype=torch.long)  # 0: prompt, k: k-th response, -1: pad
    group_of = torch.zeros(n_rows, dtype=torch.long)
    index = torch.zeros(n_rows, longest, dtype=torch.long)
    valid = torch.zeros(n_rows, longest, dtype=torch.bool)
    for g, members in enumerate(groups):
        prompt = rows[members[0]]
        p = len(prompt.prompt)
        ids[g, :p] = torch.tensor(prompt.prompt, dtype=torch.long)
        pos[g, :p] = torch.tensor(prompt.prompt_pos, dtype=torch.long)
        segment[g, :p] = 0
        start = p
        for k, i in enumerate(members, start=1):
            row, n = rows[i], len(rows[i].response)
            group_of[i] = g
            if n:
                ids[g, start : start + n] = torch.tensor(row.response, dtype=torch.long)
                pos[g, start : start + n] = torch.tensor(row.response_pos, dtype=torch.long)
                segment[g, start : start + n] = k
                # token 0 is predicted by the prompt's last position, token t by the response's t - 1
                index[i, 0] = p - 1
                index[i, 1:n] = torch.arange(start, start + n - 1)
                valid[i, :n] = True
            start += n
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    key_seg, query_seg = segment.unsqueeze(1), segment.unsqueeze(2)  # (G, 1, L), (G, L, 1)
    mask = causal & ((key_seg == 0) | (key_seg == query_seg)) & (key_seg >= 0)
    mask |= torch.eye(width, dtype=torch.bool)  # padding attends to itself (no empty softmax row)
    return PackedBatch(
        ids.to(device),
        pos.to(device),
        mask.unsqueeze(1).to(device),
        group_of.to(device),
        index.to(device),
        valid.to(device),
    )


def gather_response_outputs(outputs: torch.Tensor, packed: PackedBatch, first_kept: int = 0) -> torch.Tensor:
    """Per-row outputs ``(b, T_k, C)`` from the packed model outputs ``(G, L', C)`` that hold packed
    positions ``first_kept ..`` (``logits_to_keep``); zero where a row has no such response token."""
    index = (packed.index - first_kept).clamp(min=0)
    picked = outputs[packed.group.unsqueeze(1), index]  # (b, T_k, C)
    return picked * packed.valid.unsqueeze(-1).to(picked.dtype)
