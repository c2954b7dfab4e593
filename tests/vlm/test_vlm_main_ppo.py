"""Vision-language GRPO end to end: verl's command line (``algorithm.adv_estimator=grpo data.image_key=images
actor_rollout_ref.model.path=... actor_rollout_ref.rollout.name=hf custom_reward_function.path=...``) runs
2 steps through ``main_ppo`` on Ray (2-rank FSDP2 actor and reference) on a geo3k-layout parquet with a
tiny Qwen2.5-VL; the rollout's log-probs of the image prompts equal the actor's recompute."""

import json
import math
from pathlib import Path

from omegaconf import OmegaConf

import hybridflow.tasks.visual as visual
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo


def test_verl_command_line_trains_two_grpo_steps_on_images(
    ray_session, vlm_model_dir, visual_data, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    train, test = visual_data
    verl_command_line = [
        "algorithm.adv_estimator=grpo",
        "data.image_key=images",
        f"actor_rollout_ref.model.path={vlm_model_dir}",
        "actor_rollout_ref.rollout.name=hf",
        f"custom_reward_function.path={Path(visual.__file__)}",
    ]
    small = {
        "data.train_files": train,
        "data.val_files": test,
        "data.train_batch_size": 4,
        "data.max_prompt_length": 32,
        "data.max_response_length": 4,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.actor.use_kl_loss": True,  # the reference's log-probs on image rows too
        "actor_rollout_ref.actor.optim.lr": 1e-3,
        "trainer.logger": "[jsonl]",
        "trainer.progress_bar": False,
        "trainer.plot_curves": False,
        "trainer.val_before_train": False,
        "trainer.resume_mode": "disable",
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 2,
        "trainer.default_local_dir": str(tmp_path / "ckpt"),
        "trainer.experiment_name": "vlm",
    }
    config = load_config(verl_command_line + [f"{k}={v}" for k, v in small.items()])
    OmegaConf.resolve(config)
    run_ppo(config)
    lines = (tmp_path / "outputs" / "hybridflow" / "vlm" / "metrics.jsonl").read_text().splitlines()
    metrics = {record["step"]: record for record in map(json.loads, lines)}
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/score/mean"):
            assert math.isfinite(metrics[step][key]), (step, key)
        # rollout (HF generate with the images) against the actor's FSDP2 recompute, image prompts
        assert metrics[step]["training/rollout_log_probs_diff_max"] < 1e-4, metrics[step]
    assert metrics[2]["actor/grad_norm"] > 0
    _merged_model_generates_from_images(tmp_path / "ckpt" / "global_step_2" / "actor", tmp_path / "hf", test)


def _merged_model_generates_from_images(checkpoint, target, test_file):
    """model_merger exports a Qwen2_5_VLForConditionalGeneration directory (with its processor) that
    transformers loads and generates from, images in the prompt."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from hybridflow.model_merger import merge_fsdp_checkpoint
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.utils.dataset import RLHFDataset
    from hybridflow.utils.dataset.multimodal import load_processor

    merge_fsdp_checkpoint(checkpoint, target)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(target)
    tokenizer = load_tokenizer(target)
    processor = load_processor(target, tokenizer)
    assert processor is not None  # preprocessor_config.json travelled with the checkpoint
    item = RLHFDataset(test_file, tokenizer, {"max_prompt_length": 32}, processor=processor)[0]
    ids = torch.tensor([item["raw_prompt_ids"]])
    images = item["multi_modal_inputs"]
    output = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=images["pixel_values"],
        image_grid_thw=images["image_grid_thw"],
        mm_token_type_ids=(ids == processor.image_token_id).int(),
        max_new_tokens=3,
        do_sample=False,
    )
    assert output.shape[1] > ids.shape[1]
