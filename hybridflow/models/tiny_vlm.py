"""A tiny randomly initialised Qwen2.5-VL-architecture model, with its tokenizer, image processor
config and chat template, built offline.

:func:`build_tiny_vlm` writes the files of a standard Qwen2.5-VL directory: ``config.json``
(``Qwen2_5_VLConfig``: a vision tower with 14-pixel patches merged 2 x 2, and a Qwen2 language model
with 3-D M-RoPE), ``model.safetensors``, the tokenizer (byte-level BPE plus Qwen2-VL's vision tokens
``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``), ``chat_template.jinja``
(Qwen2-VL's: an ``{"type": "image"}`` content item becomes ``<|vision_start|><|image_pad|><|vision_end|>``)
and ``preprocessor_config.json`` (``Qwen2VLImageProcessor``). Any Qwen2.5-VL loader reads it;
:func:`hybridflow.utils.dataset.multimodal.load_processor` does without torchvision.

CLI: ``python -m hybridflow.models.tiny_vlm --out DIR``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL's chat template without the default system message (shorter prompts for the tiny model).
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tiny_vlm(
    out_dir: str | Path,
    texts: Iterable[str] | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 176,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    image_pixels: int = 56 * 56,
    vocab_size: int = 400,
    seed: int = 0,
) -> Path:
    """Write a tiny Qwen2.5-VL directory to ``out_dir`` and return its path.

    ``texts`` train the tokenizer (default: the synthetic visual task's). The image processor resizes
    every image to about ``image_pixels`` pixels (``min_pixels = max_pixels``): a 56 x 56 image is a
    ``(1, 4, 4)`` patch grid, 4 image tokens. The same arguments give the same weights."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    from hybridflow.models.tiny import build_tokenizer, save_tiny_model

    if texts is None:
        from hybridflow.tasks.visual import task_texts

        texts = task_texts()
    tokenizer = build_tokenizer(texts, vocab_size=vocab_size)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    head_dim = hidden_size // num_heads
    section = [
        head_dim // 8,
        3 * head_dim // 16,
        3 * head_dim // 16,
    ]  # Qwen2-VL's 16:24:24 split of head_dim/2
    section[0] += head_dim // 2 - sum(section)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden_size,
            intermediate_size=2 * vision_hidden_size,
            num_heads=vision_heads,
            out_hidden_size=hidden_size,
            fullatt_block_indexes=[vision_depth - 1],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    out = save_tiny_model(model, tokenizer, out_dir)
    processor = Qwen2VLImageProcessorPil(
        min_pixels=image_pixels, max_pixels=image_pixels, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    processor.save_pretrained(out)
    (out / "chat_template.jinja").write_text(QWEN2_VL_TEMPLATE)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random Qwen2.5-VL model directory offline.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny_vlm(args.out, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
