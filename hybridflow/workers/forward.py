"""The one model forward the actor, reference and critic share.

A response token at index t is predicted by the model output at the position before it, so the
outputs for the response are ``output.logits[:, -T_r - 1 : -1]``.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow import keys
from hybridflow.protocol import DataProto


def response_outputs(model: nn.Module, micro: DataProto) -> torch.Tensor:
    """Model outputs at the positions that predict each response token: ``(b, T_r, C)`` in fp32
    (C = vocabulary for a causal LM, 1 for a value head)."""
    response_len = micro.batch[keys.RESPONSES].shape[1]
    output = model(
        input_ids=micro.batch[keys.INPUT_IDS],
        attention_mask=micro.batch[keys.ATTENTION_MASK],
        position_ids=micro.batch[keys.POSITION_IDS],
        use_cache=False,
    )
    return output.logits[:, -response_len - 1 : -1, :].float()
