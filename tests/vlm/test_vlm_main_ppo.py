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
        "data.max_prompt_length": 24,
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
