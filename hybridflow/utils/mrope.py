"""Qwen2-VL's 3-D M-RoPE positions (Wang et al. 2024, arXiv 2409.12191, section 2.1), for images.

A text token has the same position ``p`` on the three axes (temporal, height, width), counting on from
the previous token. An image of ``(t, h, w)`` patches merged ``m x m`` is ``t * (h/m) * (w/m)`` tokens;
its token at grid cell ``(i, j, k)`` has positions ``(s + i, s + j, s + k)``, ``s`` being the position the
next text token would have had; the text after the image resumes at ``s + max(h, w) / m``. This is
transformers' ``Qwen2_5_VLModel.get_rope_index`` for images (the test checks it is the same), written
without a model so that rollouts, the actor's and reference's forwards and the packed rows compute it
from a row's tokens and grids alone. Positions are computed over the attended tokens only, so left
padding and the trimmed columns of a micro-batch do not change them; padding gets 0.

A row's response is text, so its positions continue from the prompt's last one on every axis: that is
verl's ``position_ids[..., -1:] + arange(1, T_r + 1)`` for Qwen2-VL rows.
"""

from __future__ import annotations

import torch


def mrope_position_ids(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    vision_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    spatial_merge_size: int,
) -> torch.Tensor:
    """``(3, B, T)`` int64 positions of ``input_ids`` (B, T).

    ``vision_mask`` (B, T) bool marks the image tokens (the prompt's ``<|image_pad|>``); their images
    are the rows of ``image_grid_thw`` (n, 3), taken in order row by row. Raises ValueError when a
    row's image tokens do not add up to its images."""
    batch, length = input_ids.shape
    positions = torch.zeros(3, batch, length, dtype=torch.long, device=input_ids.device)
    grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw.tolist()]
    next_image = 0
    for row in range(batch):
        attended = attention_mask[row].bool()
        is_vision = vision_mask[row][attended].tolist()
        row_positions, next_image = _row_positions(is_vision, grids, next_image, spatial_merge_size, row)
        positions[:, row, attended] = row_positions.to(positions.device)
    if next_image != len(grids):
        raise ValueError(f"{len(grids)} image grids for the {next_image} images of the rows' image tokens")
    return positions


def _row_positions(is_vision: list[bool], grids: list[tuple], next_image: int, merge: int, row: int):
    """``((3, n) positions of one row's n attended tokens, index of the next unused image)``."""
    parts: list[torch.Tensor] = []
    current, i, n = 0, 0, len(is_vision)
    while i < n:
        if not is_vision[i]:
            j = i
            while j < n and not is_vision[j]:
                j += 1
            parts.append(torch.arange(current, current + j - i).expand(3, -1))
            current += j - i
            i = j
            continue
        if next_image >= len(grids):
            raise ValueError(f"row {row}: image tokens with no image grid left")
        t, h, w = grids[next_image]
        next_image += 1
        tokens = t * (h // merge) * (w // merge)
        if i + tokens > n or not all(is_vision[i : i + tokens]):
            raise ValueError(
                f"row {row}: an image of grid {(t, h, w)} needs {tokens} consecutive image tokens"
            )
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
        ).reshape(3, -1)
        parts.append(grid + current)
        current += max(h, w) // merge
        i += tokens
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long), next_image
    return torch.cat(parts, dim=1), next_image
