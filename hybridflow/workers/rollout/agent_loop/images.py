"""verl's ``image_data``: a server call's images as PIL images, processed for hybridflow's engine.

verl's agent loops call ``server_manager.generate(..., image_data=images)`` with the sample's PIL images
(``multi_modal_data["image"]``, or the images of ``process_vision_info``). hybridflow's engine takes the
image processor's output, so :class:`~.server_manager.AsyncLLMServerManager` turns such a list into
``{"pixel_values": (P, 3 * 2 * 14 * 14), "image_grid_thw": (n, 3)}`` with the model's image processor
(the dataset's, :func:`hybridflow.utils.dataset.multimodal.load_processor`) before the call leaves the
agent-loop worker. ``image_data`` already in that form (a sample's ``multi_modal_inputs``) passes as is.

The prompt's ``<|image_pad|>`` tokens must be the images' ``grid_t * grid_h * grid_w / merge_size**2``
in total; otherwise the request is refused naming it.
"""

from __future__ import annotations

import torch

from hybridflow.utils.dataset.multimodal import load_image


def is_processed(image_data) -> bool:
    """Whether ``image_data`` is already the processor's output (``multi_modal_inputs``)."""
    return isinstance(image_data, dict) and "image_grid_thw" in image_data


def image_inputs(processor, image_data: list, prompt_ids: list[int], request_id: str) -> dict:
    """``{"pixel_values", "image_grid_thw"}`` of ``image_data`` (a list of PIL images, verl's image dicts
    ``{"image"|"bytes"|"path": ..., "min_pixels"?, "max_pixels"?}`` or paths), checked against the image
    tokens of ``prompt_ids``. Raises ValueError naming ``request_id``."""
    from PIL import Image

    where = f"request {request_id}"
    if processor is None:
        raise ValueError(
            f"{where}: image_data was given but the model has no image processor "
            "(no preprocessor_config.json in actor_rollout_ref.model.path)"
        )
    if not isinstance(image_data, list | tuple):
        raise ValueError(
            f"{where}: image_data must be a list of images (PIL, or dicts with 'image'/'bytes'/'path') "
            "or the sample's multi_modal_inputs (pixel_values, image_grid_thw), "
            f"not {type(image_data).__name__}"
        )
    pixels, grids = [], []
    for k, entry in enumerate(image_data):
        bound = (None, None)
        if isinstance(entry, dict) and isinstance(entry.get("image"), Image.Image):
            bound = (entry.get("min_pixels"), entry.get("max_pixels"))
            image = entry["image"].convert("RGB")
        elif isinstance(entry, Image.Image):
            image = entry.convert("RGB")
        else:
            image, bound = load_image(entry, f"{where}: image {k}")
        out = processor._pixels(image, bound)
        pixels.append(out["pixel_values"])
        grids.append(out["image_grid_thw"])
    tokens = sum(1 for t in prompt_ids if int(t) == processor.image_token_id)
    grid = torch.cat(grids) if grids else torch.zeros(0, 3, dtype=torch.long)
    wanted = sum(processor.tokens_per_image(grid)) if grids else 0
    if tokens != wanted:
        raise ValueError(
            f"{where}: the prompt has {tokens} image tokens but its {len(image_data)} image(s) give "
            f"{wanted} (image features and image tokens do not match): build prompt_ids with the "
            "processor on the same images"
        )
    if not grids:
        return {}
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": grid}
