"""Image rows, verl's way: the processor without torchvision, RLHFDataset's multi_modal fields, 3-D M-RoPE
against transformers' get_rope_index, the five bad inputs (each error names its row), and the keys that
are refused before Ray starts."""

import io
import json
import logging
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from hybridflow.models.loading import load_tokenizer
from hybridflow.utils.dataset import RLHFDataset, collate_fn
from hybridflow.utils.dataset.multimodal import MultiModalInputError, load_processor
from hybridflow.utils.mrope import mrope_position_ids

# A Qwen2.5-VL checkpoint's preprocessor_config.json as the hub ships it (the older flat layout),
# with this test's pixel bounds.
STANDARD_PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12544,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}


def _png(width, height, colour=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _row(content, images=None, truth="red"):
    row = {
        "data_source": "hybridflow/visual",
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"index": 0},
    }
    if images is not None:
        row["images"] = images
    return row


def _parquet(tmp_path, rows, name="data.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


@pytest.fixture(scope="module")
def standard_dir(vlm_model_dir, tmp_path_factory):
    """The tiny model with a hub-style preprocessor_config.json (min/max_pixels at the top level)."""
    target = tmp_path_factory.mktemp("standard") / "model"
    shutil.copytree(vlm_model_dir, target)
    (target / "preprocessor_config.json").write_text(json.dumps(STANDARD_PREPROCESSOR))
    return str(target)


@pytest.fixture(scope="module")
def vlm(standard_dir):
    tokenizer = load_tokenizer(standard_dir)
    return tokenizer, load_processor(standard_dir, tokenizer)


def test_processor_matches_transformers_image_processor_and_token_counts(vlm, tmp_path):
    from transformers import Qwen2VLImageProcessorPil

    tokenizer, processor = vlm
    with pytest.raises(ImportError):  # the point: no torchvision here (make install removes it)
        import torchvision  # noqa: F401
    images = [_png(56, 56), _png(112, 84, (10, 200, 10))]
    rows = [
        _row("<image>What colour? <image>And here?", [{"bytes": b} for b in images]),
        _row("No image.", []),
    ]
    dataset = RLHFDataset(_parquet(tmp_path, rows), tokenizer, {"max_prompt_length": 64}, processor=processor)
    item = dataset[0]
    reference = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12544)(
        [Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt"
    )
    inputs = item["multi_modal_inputs"]
    assert torch.equal(inputs["pixel_values"], reference["pixel_values"])
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]] == reference["image_grid_thw"].tolist()
    ids = item["input_ids"][item["attention_mask"].bool()]
    assert int((ids == processor.image_token_id).sum()) == int(inputs["image_grid_thw"].prod(-1).sum()) // 4
    assert [image.size for image in item["multi_modal_data"]["image"]] == [(56, 56), (112, 84)]
    text_row = dataset[1]  # a row without images stays a text row
    assert text_row["multi_modal_inputs"] == {} and text_row["multi_modal_data"] == {"image": []}
    assert "images" not in item and "images" not in text_row  # the column became multi_modal_data
    batch = collate_fn([item, text_row])
    assert batch["multi_modal_inputs"].shape == (2,)


def test_mrope_positions_equal_get_rope_index(vlm, vlm_model_dir, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer, processor = vlm
    rows = [
        _row("<image>Which side?", [{"bytes": _png(112, 56)}]),
        _row("Two: <image> and <image>, compare", [{"bytes": _png(56, 56)}, {"bytes": _png(56, 112)}]),
    ]
    dataset = RLHFDataset(_parquet(tmp_path, rows), tokenizer, {"max_prompt_length": 64}, processor=processor)
    batch = collate_fn([dataset[0], dataset[1]])  # row 0 left-padded
    ids, mask = batch["input_ids"], batch["attention_mask"]
    grid = torch.cat([r["image_grid_thw"] for r in batch["multi_modal_inputs"]])
    vision = (ids == processor.image_token_id) & mask.bool()
    ours = mrope_position_ids(ids, mask, vision, grid, spatial_merge_size=2)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_model_dir)
    reference, _ = model.model.get_rope_index(ids, vision.int(), image_grid_thw=grid, attention_mask=mask)
    assert torch.equal(ours, reference)
    assert ours[:, 1].max() < mask[1].sum()  # images take fewer positions than tokens: M-RoPE, not 1-D


def test_filter_overlong_counts_image_tokens(vlm, tmp_path, caplog):
    tokenizer, processor = vlm
    rows = [
        _row("<image>small", [{"bytes": _png(56, 56)}]),
        _row("<image>large", [{"bytes": _png(112, 112)}]),
    ]
    config = {"max_prompt_length": 20, "filter_overlong_prompts": True}
    with caplog.at_level(logging.INFO, logger="hybridflow.utils.dataset.rl_dataset"):
        dataset = RLHFDataset(_parquet(tmp_path, rows), tokenizer, config, processor=processor)
    assert len(dataset) == 1 and dataset.filtered_overlong == 1  # 4 image tokens fit, 16 do not
    assert "filtered 1 of 2" in caplog.text and "row 1" in caplog.text


def test_per_image_pixel_bounds_and_limit_images(vlm, tmp_path):
    from hybridflow.utils.dataset.multimodal import check_image_limit

    tokenizer, processor = vlm
    rows = [
        _row("<image><image>", [{"bytes": _png(112, 112), "max_pixels": 3136}, {"bytes": _png(112, 112)}])
    ]
    dataset = RLHFDataset(_parquet(tmp_path, rows), tokenizer, {"max_prompt_length": 64}, processor=processor)
    assert dataset[0]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 8]]
    check_image_limit(dataset, 2)
    with pytest.raises(MultiModalInputError, match=r"row 0: 2 images, more than .*limit_images=1"):
        check_image_limit(dataset, 1)


# ------------------------------------------------------------------ the five bad inputs


def test_bad_unreadable_image_names_the_row(vlm, tmp_path):
    tokenizer, processor = vlm
    rows = [_row("<image>ok", [{"bytes": _png(56, 56)}]), _row("<image>bad", [{"bytes": b"not a png"}])]
    with pytest.raises(MultiModalInputError, match=r"data.parquet row 1 image 0: unreadable image"):
        RLHFDataset(_parquet(tmp_path, rows), tokenizer, {"max_prompt_length": 64}, processor=processor)


@pytest.mark.parametrize("content,count", [("<image><image>two", 1), ("none here", 1)])
def test_bad_placeholder_count_names_the_row(vlm, tmp_path, content, count):
    tokenizer, processor = vlm
    rows = [_row("<image>ok", [{"bytes": _png(56, 56)}]), _row(content, [{"bytes": _png(56, 56)}] * count)]
    with pytest.raises(
        MultiModalInputError, match=r"row 1: the prompt has \d <image> placeholder.*image features and"
    ):
        RLHFDataset(_parquet(tmp_path, rows), tokenizer, {"max_prompt_length": 64}, processor=processor)


def test_bad_image_too_long_after_expansion_names_the_row(vlm, tmp_path):
    tokenizer, processor = vlm
    rows = [_row("<image>big", [{"bytes": _png(112, 112)}])]
    dataset = RLHFDataset(
        _parquet(tmp_path, rows),
        tokenizer,
        {"max_prompt_length": 20, "truncation": "left"},
        processor=processor,
    )
    with pytest.raises(
        MultiModalInputError, match=r"row 0: the prompt is \d+ tokens once its images are expanded"
    ):
        dataset[0]


def test_bad_placeholder_without_image_column_names_the_row(vlm, tmp_path):
    tokenizer, processor = vlm
    rows = [_row("plain"), _row("<image>where is it?")]
    with pytest.raises(MultiModalInputError, match=r"row 1: the prompt has 1 <image> .* no 'images' column"):
        RLHFDataset(_parquet(tmp_path, rows), tokenizer, {"max_prompt_length": 64}, processor=processor)


def test_bad_text_model_given_image_rows(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    processor = load_processor(tiny_model_dir, tokenizer)
    assert processor is None  # no preprocessor_config.json: a text-only model
    rows = [_row("<image>colour?", [{"bytes": _png(56, 56)}])]
    with pytest.raises(MultiModalInputError, match="has an 'images' column .* the model has no vision tower"):
        RLHFDataset(_parquet(tmp_path, rows), tokenizer, {"max_prompt_length": 64}, processor=processor)


def test_worker_forward_refuses_images_for_a_text_model(tiny_model_dir):
    from omegaconf import OmegaConf

    from hybridflow.workers.model_builder import load_hf_model
    from hybridflow.workers.vision_forward import vision_config

    model = load_hf_model(OmegaConf.create({"path": tiny_model_dir}), "causal_lm", torch.float32)
    with pytest.raises(ValueError, match="image rows given to a model without a vision tower"):
        vision_config(model)


# ------------------------------------------------------------------ keys refused before Ray


def test_video_column_and_return_inputs_false_are_refused(vlm, tmp_path):
    tokenizer, processor = vlm
    video = _parquet(tmp_path, [{**_row("<video>"), "videos": ["a.mp4"]}], "video.parquet")
    with pytest.raises(NotImplementedError, match="video rows are not supported"):
        RLHFDataset(video, tokenizer, {"max_prompt_length": 64}, processor=processor)
    images = _parquet(tmp_path, [_row("<image>", [{"bytes": _png(56, 56)}])])
    with pytest.raises(NotImplementedError, match="return_multi_modal_inputs=false"):
        RLHFDataset(images, tokenizer, {"return_multi_modal_inputs": False}, processor=processor)


@pytest.mark.parametrize(
    "override,message",
    [
        ("actor_rollout_ref.rollout.mode=async", "agent loops and tool rollouts"),
        ("actor_rollout_ref.rollout.name=vllm", "SIGILL, exit code -4"),
        ("algorithm.adv_estimator=gae", "a value head on it is not built"),
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "sequence parallelism with images"),
        ("actor_rollout_ref.rollout.limit_images=0", "limit_images=0"),
    ],
)
def test_vision_keys_refused_before_ray(vlm_model_dir, override, message):
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.config.vision_honesty import vision_problems

    config = load_config(
        [f"actor_rollout_ref.model.path={vlm_model_dir}", "actor_rollout_ref.rollout.name=hf", override]
    )
    assert any(__import__("re").search(message, line) for line in vision_problems(config)), vision_problems(
        config
    )
    plain = load_config(
        [f"actor_rollout_ref.model.path={vlm_model_dir}", "actor_rollout_ref.rollout.name=hf"]
    )
    assert vision_problems(plain) == []


def test_freeze_vision_tower_refused_for_a_text_model(tiny_model_dir):
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.config.vision_honesty import vision_problems

    config = load_config(
        [f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.actor.freeze_vision_tower=true"]
    )
    assert any("not a vision-language model" in line for line in vision_problems(config))
