"""ReMax end to end through ``main_ppo`` on Ray (2-rank FSDP2 workers, tiny model): each step generates
a greedy baseline response per prompt (``timing_s/gen_max``), scores it, and trains on
``return - reward_baselines``. Before the greedy baseline existed the first step crashed."""

import json
import math

from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo


def test_remax_trains_through_main_ppo(ray_session, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train, test = arithmetic_data
    values = {
        "algorithm.adv_estimator": "remax",
        "data.train_files": train,
        "data.val_files": test,
        "data.train_batch_size": 4,
        "data.max_prompt_length": 40,
        "data.max_response_length": 6,
        "actor_rollout_ref.model.path": tiny_model_dir,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.actor.optim.lr": 1e-3,
        "trainer.logger": "[jsonl]",
        "trainer.progress_bar": False,
        "trainer.plot_curves": False,
        "trainer.default_local_dir": str(tmp_path / "ckpt"),
        "trainer.resume_mode": "disable",
        "trainer.val_before_train": False,
        "trainer.total_training_steps": 2,
        "trainer.experiment_name": "remax",
    }
    config = load_config([f"{k}={v}" for k, v in values.items()])
    OmegaConf.resolve(config)
    run_ppo(config)
    lines = (tmp_path / "outputs" / "hybridflow" / "remax" / "metrics.jsonl").read_text().splitlines()
    metrics = {record["step"]: record for record in map(json.loads, lines)}
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        for key in ("timing_s/gen_max", "actor/pg_loss", "actor/grad_norm", "critic/advantages/mean"):
            assert math.isfinite(metrics[step][key]), (step, key)
    assert "critic/vf_loss" not in metrics[2]  # ReMax needs no critic
    # a micro-batch holds a prompt's 2 rows: its prompt is computed once (of two rows' FLOPs at most
    # half), and MFU counts it once
    for step in (1, 2):
        assert 0.1 < metrics[step]["perf/shared_prompt_saved_frac"] < 0.5
        assert 0 < metrics[step]["perf/mfu/actor"] < 1
