"""Padding-free forward for the actor, reference and critic: every token once, in one packed row.

The padded layout computes ``b x (T_p + T_r)`` positions through every dense layer, and the ``n``
responses of a GRPO prompt repeat its prompt ``n`` times. Packed, the micro-batch is one row of ``N``
tokens: each distinct prompt once, then the responses that follow it, no padding anywhere. The
projections and MLP (most of the FLOPs) run over exactly the ``N`` real tokens.

Attention is computed per row of the padded layout, gathered from the packed tokens: row ``r`` has the
keys ``[its prompt | its response]``; its queries are its response tokens, plus the prompt tokens for
the first row of a prompt group (every token is the query of exactly one row). Each query attends
causally within its row's keys, so every token sees exactly what it saw in its own padded row, and
outputs and gradients are those of the padded layout (a shared prompt accumulates the gradients of
all its responses). :func:`hybridflow.models.attention.cpu_attention_forward` runs this form when
the 4-D mask it is given carries a :class:`PackedRows` (``mask.packed_rows``); the mask passes
through the model untouched, as a prepared 4-D mask does in transformers.

Used with the CPU attention only (:func:`plan_packed_rows` checks), where it replaces the dense block
mask of :mod:`hybridflow.workers.shared_prefix`. Shapes: ``b`` rows, ``N`` packed tokens, ``Q`` the
most queries of a row, ``K`` the longest row (prompt + response), ``T_k`` the longest response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow import keys
from hybridflow.models.attention import PackedRows
from hybridflow.protocol import DataProto
from hybridflow.workers.shared_prefix import prompt_groups, repeated_prompts, split_rows

# Pack only when the packed row has at most this fraction of the padded layout's positions
# (gathering queries, keys and outputs per layer costs a few percent).
MAX_TOKEN_FRACTION = 0.95


@dataclass
class PackedInputs:
    """Model inputs of the packed layout and where each row's outputs are in it."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N) each token's position in its own padded row
    attention_mask: torch.Tensor  # (b, 1, Q, K) bool, True = may attend; ``.packed_rows`` set (one
    # row queried whole: a stride-0 placeholder, ``packed_rows.causal``; the attention applies causal)
    kept_positions: torch.Tensor  # (M,) packed tokens whose outputs predict some response token
    predictor: torch.Tensor  # (b, T_k) index into kept_positions predicting response token t
    valid: torch.Tensor  # (b, T_k) bool, response token t exists in the row
    repeated_prompts: list[int] = field(default_factory=list)  # shared_prefix.repeated_prompts


def plan_packed_rows(micro: DataProto, padded_width: int, always: bool = False) -> PackedInputs | None:
    """The packed layout of ``micro`` (rows ``[prompt, left-padded | response, right-padded]``) when it
    has at most :data:`MAX_TOKEN_FRACTION` of the ``b x padded_width`` positions (or ``always``: the
    layout sequence parallelism slices), else None. Rows whose prompt is empty or whose response has
    an unattended column before its last attended one keep the padded layout (their attention is not
    a prefix of the row)."""
    rows = split_rows(micro)
    if any(not row.prompt for row in rows) or _has_response_gaps(micro):
        return None
    groups = prompt_groups(rows)
    tokens = sum(len(rows[g[0]].prompt) + sum(len(rows[i].response) for i in g) for g in groups)
    if not always and tokens > MAX_TOKEN_FRACTION * len(rows) * padded_width:
        return None
    packed = _build(rows, groups, micro.batch[keys.INPUT_IDS].device)
    packed.repeated_prompts = repeated_prompts(rows, groups)
    return packed


def _has_response_gaps(micro: DataProto) -> bool:
    prompt_len = micro.batch[keys.INPUT_IDS].shape[1] - micro.batch[keys.RESPONSES].shape[1]
    attended = micro.batch[keys.ATTENTION_MASK][:, prompt_len:].bool()
    # right-padded: once a column is unattended, every later one must be too
    return bool((attended[:, 1:] & ~attended[:, :-1]).any())


def _build(rows, groups: list[list[int]], device: torch.device) -> PackedInputs:
    ids: list[int] = []
    pos: list[int] = []
    queries: list[list[int]] = [[] for _ in rows]  # packed tokens queried by each row
    row_keys: list[list[int]] = [[] for _ in rows]
    first_key: list[int] = [0] * len(rows)  # key slot of each row's first query
    predict: list[list[int]] = [[] for _ in rows]  # packed token predicting response token t
    for members in groups:
        prompt = rows[members[0]]
        prompt_tokens = list(range(len(ids), len(ids) + len(prompt.prompt)))
        ids.extend(prompt.prompt)
        pos.extend(prompt.prompt_pos)
        for k, i in enumerate(members):
            row = rows[i]
            response_tokens = list(range(len(ids), len(ids) + len(row.response)))
            ids.extend(row.response)
            pos.extend(row.response_pos)
            row_keys[i] = prompt_tokens + response_tokens
            if k == 0:
                queries[i] = prompt_tokens + response_tokens
            else:
                queries[i], first_key[i] = response_tokens, len(prompt_tokens)
            # token 0 is predicted by the prompt's last position, token t by response token t - 1
            predict[i] = ([prompt_tokens[-1]] + response_tokens[:-1]) if response_tokens else []
    num_rows, num_tokens = len(rows), len(ids)
    max_queries = max(1, max(len(q) for q in queries))
    max_keys = max(len(k) for k in row_keys)
    query_index = torch.zeros(num_rows, max_queries, dtype=torch.long)
    key_index = torch.zeros(num_rows, max_keys, dtype=torch.long)
    query_key_slot = torch.zeros(num_rows, max_queries, dtype=torch.long)  # causal limit per query
    key_count = torch.zeros(num_rows, dtype=torch.long)
    token_slot = torch.zeros(num_tokens, dtype=torch.long)
    for r in range(num_rows):
        q, k = queries[r], row_keys[r]
        key_index[r, : len(k)] = torch.tensor(k, dtype=torch.long)
        key_count[r] = len(k)
        if q:
            query_index[r, : len(q)] = torch.tensor(q, dtype=torch.long)
            query_key_slot[r, : len(q)] = torch.arange(first_key[r], first_key[r] + len(q))
            token_slot[torch.tensor(q, dtype=torch.long)] = r * max_queries + torch.arange(len(q))
    # one row queried whole (a single sequence): plain causal; no O(T^2) mask (PackedRows.causal)
    whole_row = num_rows == 1 and max_queries == max_keys == num_tokens
    if whole_row:
        mask = torch.ones(1, 1, 1, dtype=torch.bool, device=device).expand(1, max_queries, max_keys)
    else:
        key_slots = torch.arange(max_keys)
        mask = (key_slots[None, None, :] <= query_key_slot[:, :, None]) & (
            key_slots[None, None, :] < key_count[:, None, None]
        )  # unused query slots attend to key slot 0 only (a finite softmax row, never read)
    kept = sorted({t for p in predict for t in p})
    kept_at = {t: j for j, t in enumerate(kept)}
    longest = max(1, max(len(p) for p in predict))
    predictor = torch.zeros(num_rows, longest, dtype=torch.long)
    valid = torch.zeros(num_rows, longest, dtype=torch.bool)
    for r, p in enumerate(predict):
        if p:
            predictor[r, : len(p)] = torch.tensor([kept_at[t] for t in p], dtype=torch.long)
            valid[r, : len(p)] = True
    attention_mask = mask.unsqueeze(1).to(device)
    attention_mask.packed_rows = PackedRows(
        query_index.to(device), key_index.to(device), token_slot.to(device), causal=whole_row
    )
    return PackedInputs(
        torch.tensor([ids], dtype=torch.long, device=device),
        torch.tensor([pos], dtype=torch.long, device=device),
        attention_mask,
        torch.tensor(kept or [0], dtype=torch.long, device=device),
        predictor.to(device),
        valid.to(device),
    )


def gather_packed_outputs(outputs: torch.Tensor, packed: PackedInputs, at_kept: bool) -> torch.Tensor:
    """Per-row outputs ``(b, T_k, C)`` from the packed outputs: ``(1, M, C)`` at ``kept_positions``
    when ``at_kept``, else ``(1, N, C)`` at every packed token; zero where a row has no such token."""
    if not at_kept:
        outputs = outputs[:, packed.kept_positions]
    picked = outputs[0][packed.predictor]  # (b, T_k, C)
    return picked * packed.valid.unsqueeze(-1).to(picked.dtype)
