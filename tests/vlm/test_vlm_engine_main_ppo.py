"""Vision-language GRPO with the embedded engine as the rollout: verl's command line of
test_vlm_main_ppo.py with ``actor_rollout_ref.rollout.name=engine`` runs 2 steps through ``main_ppo`` on
Ray (2-rank FSDP2 actor and reference, a tiny Qwen2.5-VL, image prompts), synchronously and through
the agent loops (``rollout.mode=async``, ``tool_agent``: each call to the engine's server carries the
sample's images); the engine's log-probs of the sampled responses equal the actor's FSDP2 recompute on
the same image+text rows. Slow tier: the fast
tier checks the parts (tests/vlm/test_vlm_engine.py: engine = HF generate/forward, engine rollout =
the actor's recompute after a vision-tower sync) and keeps the HF-rollout run whole."""

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import hybridflow.tasks.visual as visual
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo


@pytest.mark.slow
@pytest.mark.parametrize(
    "loops",
    [
        [],
        # agent loops (tool_agent: multi-turn on, no tools) on the engine's server, images per call
        ["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=true"],
    ],
    ids=["sync", "agent_loop"],
)
def test_verl_command_line_with_the_engine_trains_two_grpo_steps_on_images(
    ray_session, vlm_model_dir, visual_data, tmp_path, monkeypatch, loops
):
    monkeypatch.chdir(tmp_path)
    train, test = visual_data
    command_line = [
        "algorithm.adv_estimator=grpo",
        "data.image_key=images",
        f"actor_rollout_ref.model.path={vlm_model_dir}",
        "actor_rollout_ref.rollout.name=engine",
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
        "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.optim.lr": 1e-3,
        "trainer.logger": "[jsonl]",
        "trainer.progress_bar": False,
        "trainer.plot_curves": False,
        "trainer.val_before_train": True,  # validation (greedy) through the engine too
        "trainer.resume_mode": "disable",
        "trainer.total_training_steps": 2,
        "trainer.save_freq": -1,
        "trainer.default_local_dir": str(tmp_path / "ckpt"),
        "trainer.experiment_name": "vlm_engine",
    }
    config = load_config(command_line + [f"{k}={v}" for k, v in small.items()] + loops)
    OmegaConf.resolve(config)
    run_ppo(config)
    lines = (tmp_path / "outputs" / "hybridflow" / "vlm_engine" / "metrics.jsonl").read_text().splitlines()
    metrics = {}
    for record in map(json.loads, lines):
        metrics.setdefault(record["step"], {}).update(record)
    assert {1, 2} <= set(metrics)
    for step in (1, 2):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/score/mean"):
            assert math.isfinite(metrics[step][key]), (step, key)
        # the engine's log-probs (image features in the prefill, M-RoPE decode) = the actor's recompute
        assert metrics[step]["training/rollout_log_probs_diff_max"] < 1e-4, metrics[step]
    assert any(key.startswith("val") for key in metrics[0]), metrics.get(0)
