"""The actor's, reference's and rollout's forward on image+text rows (Qwen2-VL / Qwen2.5-VL).

Rows carry ``multi_modal_inputs`` (``pixel_values`` (P_i, D), ``image_grid_thw`` (n_i, 3), ``{}`` for a
text row) in the non-tensor batch. A micro-batch's images are concatenated in row order and the
vision tower encodes them inside the model's own forward, so FSDP2 gathers its weights like any
other layer's and its gradients flow (unless ``actor.freeze_vision_tower``). Positions are the 3-D
M-RoPE of :func:`hybridflow.utils.mrope.mrope_position_ids`, computed from the micro-batch's attended
tokens (trimmed or not, the same), with only the *prompt's* ``<|image_pad|>`` tokens as images.

The policy never emits an image or video placeholder token: their logits are set to -1e30
wherever image rows are scored or sampled (:func:`suppress_vision_tokens`; HF ``generate``'s
``suppress_tokens`` in the rollout). A response holding one would otherwise make the next forward
count more image tokens than image features ("Image features and image tokens do not match"), and
sampling and scoring the same truncated distribution keeps rollout and trainer log-probs equal.

Image rows take the padded layout of :mod:`hybridflow.workers.forward` (trimmed columns), not the
packed rows: those gather attention per row around one packed token sequence, and the vision
tower's image features would have to be placed once per shared prompt.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.utils.mrope import mrope_position_ids
from hybridflow.workers.lora import unwrap_peft


def has_images(data: DataProto) -> bool:
    """True when ``data`` carries verl's ``multi_modal_inputs`` (a vision-language batch)."""
    return keys.MULTI_MODAL_INPUTS in data.non_tensor_batch


def vision_config(model: nn.Module):
    """The HF config of a vision-language model (has ``vision_config``); raises otherwise."""
    config = unwrap_peft(model).config
    if getattr(config, "vision_config", None) is None or getattr(config, "image_token_id", None) is None:
        raise ValueError(
            f"image rows given to a model without a vision tower (model_type={config.model_type!r}); use a "
            "Qwen2-VL / Qwen2.5-VL model, or drop data.image_key's column"
        )
    return config


def vision_token_ids(config) -> list[int]:
    """The placeholder tokens a policy must not emit: image and video pads."""
    return [int(t) for t in (config.image_token_id, getattr(config, "video_token_id", None)) if t is not None]


# A suppressed token's logit: exp() of it is 0 against any real logit, it stays finite divided by a
# temperature (-inf would make the entropy's 0 * logit a NaN), and bf16 holds it.
SUPPRESSED_LOGIT = -1e30


def suppress_vision_tokens(logits: torch.Tensor, config) -> torch.Tensor:
    """``logits`` (..., V) with the image/video placeholder columns at :data:`SUPPRESSED_LOGIT`."""
    logits = logits.clone()
    logits[..., vision_token_ids(config)] = SUPPRESSED_LOGIT
    return logits


def image_tensors(data: DataProto) -> dict[str, torch.Tensor] | None:
    """The rows' ``pixel_values`` (P, D) and ``image_grid_thw`` (n, 3), concatenated in row order; None
    when no row has an image."""
    rows = [r for r in data.non_tensor_batch[keys.MULTI_MODAL_INPUTS] if r and "image_grid_thw" in r]
    if not rows:
        return None
    return {
        "pixel_values": torch.cat([r["pixel_values"] for r in rows]),
        "image_grid_thw": torch.cat([r["image_grid_thw"] for r in rows]).long(),
    }


def check_image_tokens(data: DataProto, prompt_len: int, config) -> None:
    """Each row's prompt holds as many image tokens as its images' features (else a ValueError naming
    the row: verl's users' "Image features and image tokens do not match")."""
    merge = int(config.vision_config.spatial_merge_size)
    ids = data.batch[keys.INPUT_IDS][:, :prompt_len]
    mask = data.batch[keys.ATTENTION_MASK][:, :prompt_len].bool()
    tokens = ((ids == int(config.image_token_id)) & mask).sum(dim=1).tolist()
    for row, inputs in enumerate(data.non_tensor_batch[keys.MULTI_MODAL_INPUTS]):
        grid = (inputs or {}).get("image_grid_thw")
        features = 0 if grid is None else int((grid.prod(-1) // merge**2).sum())
        if tokens[row] != features:
            index = data.non_tensor_batch.get("index")
            name = f" (dataset index {index[row]})" if index is not None else ""
            raise ValueError(
                f"row {row}{name}: {tokens[row]} image tokens in the prompt but {features} image features "
                "in multi_modal_inputs (image features and image tokens do not match)"
            )


def vision_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    images: dict[str, torch.Tensor] | None,
    logits_to_keep: int,
) -> torch.Tensor:
    """Logits (b, k, V) at the last ``logits_to_keep`` columns of ``input_ids`` (b, T) (prompt in the
    first ``prompt_len`` columns), images encoded in the forward, M-RoPE positions, placeholder tokens
    suppressed."""
    config = vision_config(model)
    vision_mask = torch.zeros_like(attention_mask, dtype=torch.bool)
    vision_mask[:, :prompt_len] = (input_ids[:, :prompt_len] == int(config.image_token_id)) & attention_mask[
        :, :prompt_len
    ].bool()
    grid = None if images is None else images["image_grid_thw"]
    positions = mrope_position_ids(
        input_ids, attention_mask, vision_mask, grid, int(config.vision_config.spatial_merge_size)
    )
    extra = {} if images is None else dict(images)
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=False,
        logits_to_keep=logits_to_keep,
        **extra,
    )
    return suppress_vision_tokens(output.logits, config)


def vision_response_outputs(model: nn.Module, micro: DataProto, first: int, end: int, prompt_len: int):
    """:func:`hybridflow.workers.forward.response_outputs` for image rows: ``(b, T_k, V)`` fp32 in the
    padded layout, columns ``[first, end)``."""
    config = vision_config(model)
    check_image_tokens(micro, prompt_len, config)
    kept_response_len = end - prompt_len
    logits = vision_logits(
        model,
        micro.batch[keys.INPUT_IDS][:, first:end],
        micro.batch[keys.ATTENTION_MASK][:, first:end],
        prompt_len - first,
        image_tensors(micro),
        kept_response_len + 1,
    )
    return logits[:, -kept_response_len - 1 : -1, :].float()


def generate_kwargs(model: nn.Module, prompts: DataProto) -> dict:
    """What HF ``generate`` needs for image prompts (B, T_p): the images, ``mm_token_type_ids`` (1 on
    image tokens: transformers computes the prefill's M-RoPE from it, then decodes on with its
    per-row offset) and the placeholder tokens to suppress."""
    config = vision_config(model)
    prompt_len = prompts.batch[keys.INPUT_IDS].shape[1]
    check_image_tokens(prompts, prompt_len, config)
    ids, mask = prompts.batch[keys.INPUT_IDS], prompts.batch[keys.ATTENTION_MASK]
    kwargs = dict(image_tensors(prompts) or {})
    if kwargs:
        kwargs["mm_token_type_ids"] = ((ids == int(config.image_token_id)) & mask.bool()).int()
    return kwargs


def sampled_log_probs(step_logits: tuple, tokens: torch.Tensor, temperature: float, config) -> torch.Tensor:
    """``(B, T)`` log-probs of the sampled ``tokens`` (B, T) under the raw logits of each step (``T``
    tensors (B, V), HF's ``output_logits``), scaled by ``temperature`` with the placeholders suppressed:
    the distribution the actor scores (no top-k / top-p truncation, as the actor recomputes)."""
    logits = torch.stack(step_logits, dim=1).float()
    logits = suppress_vision_tokens(logits, config)
    if temperature not in (0, 1.0):
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, : logits.shape[1], None]).squeeze(-1)
