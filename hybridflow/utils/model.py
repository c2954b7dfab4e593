"""Small model-input helpers of verl's ``verl.utils.model`` (masks and position ids for tests and
data preparation). Shapes: ``input_ids``, masks and position ids are ``(B, T)``."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.errors import InvalidInputError

__all__ = ["compute_position_id_with_mask", "create_random_mask"]


def create_random_mask(
    input_ids: torch.Tensor,
    max_ratio_of_valid_token: float,
    max_ratio_of_left_padding: float,
    min_ratio_of_valid_token: float = 0,
) -> torch.Tensor:
    """A random ``(B, T)`` int64 attention mask: each row is ``l`` zeros (left padding), ``v`` ones,
    then zeros (right padding).

    ``l`` is uniform in ``[0, int(T * max_ratio_of_left_padding)]`` and ``v`` uniform in
    ``[max(1, int(T * min_ratio_of_valid_token)), int(T * max_ratio_of_valid_token)]``, drawn row by
    row from numpy's global generator in verl's order, so a seeded run gives verl's masks.
    """
    if not (0 < max_ratio_of_valid_token <= 1 and 0 <= max_ratio_of_left_padding < 1):
        raise InvalidInputError("ratios must satisfy 0 < max valid <= 1 and 0 <= max left padding < 1")
    if min_ratio_of_valid_token > max_ratio_of_valid_token:
        raise InvalidInputError("min_ratio_of_valid_token exceeds max_ratio_of_valid_token")
    batch_size, seq_len = input_ids.shape
    max_valid = int(seq_len * max_ratio_of_valid_token)
    min_valid = max(1, int(seq_len * min_ratio_of_valid_token))
    max_left = int(seq_len * max_ratio_of_left_padding)
    if max_valid < 1 or max_valid + max_left > seq_len:
        raise InvalidInputError(
            f"{max_valid} valid + {max_left} padding tokens do not fit a length of {seq_len}"
        )
    starts, ends = np.empty(batch_size, np.int64), np.empty(batch_size, np.int64)
    for i in range(batch_size):
        starts[i] = np.random.randint(low=0, high=max_left + 1, dtype=np.int64)
        ends[i] = starts[i] + np.random.randint(low=min_valid, high=max_valid + 1, dtype=np.int64)
    positions = torch.arange(seq_len)
    keep = (positions >= torch.from_numpy(starts)[:, None]) & (positions < torch.from_numpy(ends)[:, None])
    return keep.to(torch.int64).to(input_ids.device)


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only: ``clip(cumsum(mask) - 1, min=0)``, ``(B, T)``.
    E.g. mask ``[0, 0, 1, 1, 1]`` gives ``[0, 0, 0, 1, 2]``."""
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0, max=None)
