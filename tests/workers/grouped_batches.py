"""Micro-batches in the padded layout of the actor/critic forward, rows grouped by prompt (GRPO's ``n``)."""

import torch

from hybridflow import keys
from hybridflow.protocol import DataProto

PAD = 0


def grouped_batch(
    prompts: list[list[int]],
    response_lengths: list[list[int]],
    prompt_len: int,
    response_len: int,
    token_range: tuple[int, int],
) -> DataProto:
    """Rows ``[prompt, left-padded to prompt_len | response, right-padded to response_len]``: for
    prompt i one row per entry of ``response_lengths[i]``, with random response tokens drawn (seed 0)
    from ``token_range``."""
    gen = torch.Generator().manual_seed(0)
    ids, mask = [], []
    for prompt, lengths in zip(prompts, response_lengths, strict=True):
        for n in lengths:
            response = torch.randint(*token_range, (n,), generator=gen).tolist()
            left, right = prompt_len - len(prompt), response_len - n
            ids.append([PAD] * left + prompt + response + [PAD] * right)
            mask.append([0] * left + [1] * (len(prompt) + n) + [0] * right)
    input_ids, attention_mask = torch.tensor(ids), torch.tensor(mask)
    return DataProto.from_dict(
        {
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: attention_mask,
            keys.POSITION_IDS: (attention_mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: input_ids[:, prompt_len:],
            keys.RESPONSE_MASK: attention_mask[:, prompt_len:],
        }
    )
