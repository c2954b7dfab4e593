"""Images in the embedded engine (Qwen2.5-VL): the vision tower, the merged prefill embeddings, M-RoPE.

A Qwen2.5-VL checkpoint is a Qwen2 language model (its weights under ``model.language_model.*``) plus a
vision tower (``model.visual.*``). The engine holds the language model in its own fused layout, as for
any Qwen2 model, and runs the vision tower with the Hugging Face module (:class:`VisionTower`: a copy
built from ``vision_config`` whose parameters every weight sync refills by name, like the engine's own).

A prompt with images is prefilled from embeddings, not token ids (:func:`image_prefill_inputs`): the
token embeddings with the image features scattered over the ``<|image_pad|>`` positions in row order
(transformers' ``masked_scatter`` in ``Qwen2_5_VLModel.forward``), and per-token cos/sin of the 3-D
M-RoPE positions (:func:`mrope_cos_sin`; positions from :func:`hybridflow.utils.mrope.mrope_position_ids`,
which equals transformers' ``get_rope_index``). Every token generated after the prompt is text: its three
position components are equal, ``cache_len + rope_delta`` with the row's ``rope_delta = max(prompt
positions) + 1 - prompt_len`` (<= 0), so decoding is plain RoPE read at that position (the decode
step's per-row offset), and nothing else about the decode step changes.

Shapes: P prompts right-padded to T tokens, H hidden size, hd head dim, N image tokens of a prefill.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.utils.mrope import mrope_position_ids

# model_type -> the prefix of the language model's parameters (the vision tower is ``model.visual``)
VISION_LANGUAGE_TYPES = {"qwen2_5_vl": "model.language_model."}
VISION_PREFIX = "model.visual."


def is_vision_language(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def language_config(config):
    """The config the engine's layout reads: a vision-language model's ``text_config`` (with the
    top-level ``tie_word_embeddings``), else ``config``; raises for a vision-language type the engine
    does not serve."""
    if not is_vision_language(config):
        return config
    if config.model_type not in VISION_LANGUAGE_TYPES:
        raise NotImplementedError(
            f"the embedded engine serves the vision-language types {sorted(VISION_LANGUAGE_TYPES)}, not "
            f"model_type={config.model_type!r}; use actor_rollout_ref.rollout.name=hf"
        )
    return config.text_config


def weight_prefix(config) -> str:
    """Where the decoder's parameters live: ``model.`` (Llama, Qwen2, ...) or a vision-language
    model's ``model.language_model.``."""
    return VISION_LANGUAGE_TYPES[config.model_type] if is_vision_language(config) else "model."


class VisionTower:
    """The engine's copy of the HF vision tower: parameters filled by name (``model.visual.*``),
    freed by :meth:`release` and re-allocated by :meth:`allocate` (the non-persistent buffers, such as
    the rotary table, are kept aside and restored)."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device) -> None:
        from transformers.initialization import no_init_weights
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        self.device = torch.device(device)
        with no_init_weights():  # the first sync fills every parameter
            module = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config, dtype=dtype)
        self.module: nn.Module = module.to(self.device).eval().requires_grad_(False)
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = getattr(config, "video_token_id", None)
        self.merge = int(config.vision_config.spatial_merge_size)
        self._buffers = {name: b.clone() for name, b in self.module.named_buffers()}
        self.allocated = True

    def allocate(self) -> None:
        if self.allocated:
            return
        self.module.to_empty(device=self.device)
        for name, value in self._buffers.items():
            self.module.get_buffer(name).copy_(value)
        self.allocated = True

    def release(self) -> None:
        self.module.to_empty(device="meta")
        self.allocated = False

    def targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF parameter name -> (tensor, 0, rows): the engine's weight table for the tower."""
        return {VISION_PREFIX + n: (p.data, 0, p.shape[0]) for n, p in self.module.named_parameters()}

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged image features (N, H) of the patches (patches, D) of images of ``grid_thw`` (n, 3),
        in image order: ``grid_thw.prod(-1).sum() / merge**2`` rows."""
        dtype = next(self.module.parameters()).dtype
        pixels = pixel_values.to(device=self.device, dtype=dtype)
        return self.module(pixels, grid_thw=grid_thw.to(self.device)).pooler_output

    def image_tokens(self, images: dict | None) -> int:
        """How many ``<|image_pad|>`` tokens the images of ``images`` (``image_grid_thw`` (n, 3)) fill."""
        if not images:
            return 0
        return int((images["image_grid_thw"].prod(-1) // self.merge**2).sum())

    def checked_images(self, prompt_ids: list[int], images: dict | None, name: str) -> dict | None:
        """``images`` (None for a text prompt) after checking that the prompt's image tokens are as
        many as the images' features (else a ValueError starting with ``name``, the request)."""
        tokens = sum(1 for t in prompt_ids if t == self.image_token_id)
        features = self.image_tokens(images)
        if tokens != features:
            raise ValueError(
                f"{name}the prompt has {tokens} image tokens but its images have {features} features "
                "(image features and image tokens do not match)"
            )
        return images or None


def mrope_axes(section, head_dim: int) -> torch.Tensor:
    """(hd,) which position axis (0 temporal, 1 height, 2 width) each rotary dimension reads:
    ``mrope_section`` over the first half, repeated for the second (transformers'
    ``recomposition_frequencies``)."""
    half = [axis for axis, width in enumerate(section) for _ in range(int(width))]
    if len(half) * 2 != head_dim:
        raise ValueError(f"mrope_section={list(section)} does not cover head_dim {head_dim} / 2")
    return torch.tensor(half * 2)


def mrope_cos_sin(
    cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, axes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (P, T, 1, hd) of 3-D ``positions`` (3, P, T) from the 1-D tables (max_positions, hd):
    dimension d reads the table at ``positions[axes[d]]``. A table entry is ``cos(p * inv_freq[d])``,
    which is what transformers' M-RoPE computes per axis, so the values are the same."""
    index = axes.to(positions.device).view(1, 1, 1, -1).expand(1, *positions.shape[1:], -1)
    cos = cos_table[positions].gather(0, index)[0]  # (P, T, hd)
    sin = sin_table[positions].gather(0, index)[0]
    return cos.unsqueeze(2), sin.unsqueeze(2)


def image_prefill_inputs(model, tokens: torch.Tensor, lengths: torch.Tensor, images: list[dict | None]):
    """The prefill's inputs for prompts ``tokens`` (P, T) right-padded to ``lengths`` (P,), the p-th
    with ``images[p]`` (``pixel_values``, ``image_grid_thw``; None or {} for a text prompt):

    - ``embeds`` (P, T, H): token embeddings, the image features at the image tokens;
    - ``rope``: cos and signed sin (P, T, 1, hd) at each token's M-RoPE position (text prompts:
      positions 0..len-1 on all three axes, which is plain RoPE);
    - ``deltas`` (P,) int64: each row's ``rope_delta`` (decode position = cache length + delta)."""
    vision: VisionTower = model.vision
    mask = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]  # (P, T)
    with_images = torch.tensor([bool(i) for i in images], device=tokens.device)
    vision_mask = (tokens == vision.image_token_id) & mask & with_images[:, None]
    embeds = model._embed(tokens)
    grids = [i["image_grid_thw"] for i in images if i]
    grid = torch.cat(grids).long() if grids else None
    if grids:
        features = vision.encode(torch.cat([i["pixel_values"] for i in images if i]), grid)
        if features.shape[0] != int(vision_mask.sum()):
            tokens = int(vision_mask.sum())
            raise ValueError(
                f"{tokens} image tokens in the prompts but {features.shape[0]} image features "
                "(image features and image tokens do not match)"
            )
        embeds = embeds.masked_scatter(vision_mask.unsqueeze(-1), features.to(embeds.dtype))
    positions = mrope_position_ids(tokens.cpu(), mask.cpu(), vision_mask.cpu(), grid, vision.merge)
    positions = positions.to(tokens.device)
    last = positions.masked_fill(~mask, -1).amax(dim=(0, 2))  # (P,) the largest position of each prompt
    deltas = last + 1 - lengths
    rope = mrope_cos_sin(model.rope_cos, model.rope_sin_signed, positions, model.mrope_axes)
    return embeds, rope, deltas


def image_inputs_past_prefix(
    model, full: list[list[int]], images: list[dict | None], starts: list[int], width: int
) -> tuple[dict, list[int]]:
    """A prefill's inputs for P prompts ``full`` (each its whole token list) of which the first
    ``starts[p]`` tokens are cached: :func:`image_prefill_inputs` over each whole prompt (image features
    and M-RoPE positions depend on all of it), then cut to the ``width`` new positions after each
    prefix. Returns ``({"embeds": (P, width, H), "rope": (cos, sin) (P, width, 1, hd)}, deltas)`` with
    ``deltas`` each row's ``rope_delta``; positions past a row's end repeat its last."""
    device = model.device
    lengths = torch.tensor([len(tokens) for tokens in full], device=device)
    tokens = torch.zeros(len(full), int(lengths.max()), dtype=torch.long)
    for row, row_tokens in enumerate(full):
        tokens[row, : len(row_tokens)] = torch.tensor(row_tokens)
    embeds, (cos, sin), deltas = image_prefill_inputs(model, tokens.to(device), lengths, images)
    index = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)[None, :]
    index = index.clamp(max=embeds.shape[1] - 1)  # (P, width): each row's new positions (padding clamped)

    def take(t: torch.Tensor) -> torch.Tensor:  # t (P, T_full, ...) -> (P, width, ...) at ``index``
        return t.gather(1, index.view(*index.shape, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:]))

    cos = cos.expand(len(full), *cos.shape[1:]) if cos.shape[0] == 1 else cos
    sin = sin.expand(len(full), *sin.shape[1:]) if sin.shape[0] == 1 else sin
    return {"embeds": take(embeds), "rope": (take(cos), take(sin))}, deltas.tolist()
