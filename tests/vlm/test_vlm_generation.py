"""``main_generation`` and ``main_eval`` with image rows: ``rollout.name=hf`` generates from the images of a
geo3k-layout parquet with a tiny Qwen2.5-VL, main_eval scores the output; a bad row is named; a text-only
model is sent to the engine."""

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

import hybridflow.tasks.visual as visual
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_eval import run_eval
from hybridflow.trainer.main_generation import run_generation


def _generation_config(model_dir, data_path, output, **extra):
    values = {
        "model.path": model_dir,
        "data.path": data_path,
        "data.output_path": output,
        "data.n_samples": 2,
        "data.batch_size": 4,
        "rollout.name": "hf",
        "rollout.prompt_length": 32,
        "rollout.response_length": 3,
        **extra,
    }
    config = load_config([f"{k}={v}" for k, v in values.items()], config_name="generation")
    OmegaConf.resolve(config)
    return config


def test_generation_and_eval_take_image_rows(vlm_model_dir, visual_data, tmp_path):
    output = str(tmp_path / "generations.parquet")
    run_generation(_generation_config(vlm_model_dir, visual_data[1], output))
    table = pq.read_table(output)
    responses = table.column("responses").to_pylist()
    assert len(responses) == 9 and all(len(r) == 2 and all(isinstance(s, str) for s in r) for r in responses)
    assert "images" in table.column_names  # the input rows are kept
    evaluation = load_config(
        [f"data.path={output}", f"custom_reward_function.path={visual.__file__}"], config_name="evaluation"
    )
    metrics = run_eval(evaluation)
    assert set(metrics) == {visual.DATA_SOURCE}


def test_generation_names_a_bad_image_row(vlm_model_dir, visual_data, tmp_path):
    rows = pq.read_table(visual_data[1]).to_pylist()[:3]
    rows[2]["images"] = [{"bytes": b"broken"}]
    broken = visual.write_parquet(rows, tmp_path / "broken.parquet")
    with pytest.raises(ValueError, match=r"broken.parquet row 2 image 0: unreadable image"):
        run_generation(_generation_config(vlm_model_dir, broken, str(tmp_path / "out.parquet")))


def test_generation_hf_needs_a_vision_language_model(tiny_model_dir, visual_data, tmp_path):
    with pytest.raises(ValueError, match="a text-only model\\): use rollout.name=engine"):
        run_generation(_generation_config(tiny_model_dir, visual_data[1], str(tmp_path / "out.parquet")))
