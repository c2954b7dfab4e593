"""``algorithm.rollout_correction`` through ``run_ppo``: the decoupled mode's IS weights and rejection
reach the update and log ``rollout_corr/*``; bypass mode trains with π_old = π_rollout and the
``bypass_mode`` loss, without the old-log-prob pass."""

import json
import math

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from tests.tiny_run import as_overrides, tiny_run_values


def _run(model_dir, data, tmp, name, **extra) -> dict[int, dict]:
    values = tiny_run_values(
        model_dir,
        data,
        tmp / "ckpt",
        **{
            "trainer.n_gpus_per_node": 1,
            "trainer.experiment_name": name,
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 2,
            "actor_rollout_ref.actor.optim.lr": 1e-2,
            "actor_rollout_ref.actor.entropy_coeff": 0.01,
            **extra,
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        run_ppo(config)
    lines = (tmp / "outputs" / "hybridflow" / name / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def test_decoupled_token_is_and_rejection(ray_session, tiny_model_dir, arithmetic_data, tmp_path):
    metrics = _run(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        "decoupled",
        **{
            "algorithm.rollout_correction.rollout_is": "token",
            "algorithm.rollout_correction.rollout_rs": "token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold": 2.0,
        },
    )
    for step in (1, 2):
        record = metrics[step]
        # the engine and the actor agree (fp32): every weight is ~1 and nothing is rejected
        assert record["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert record["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert abs(record["rollout_corr/kl"]) < 1e-5
        assert "training/rollout_log_probs_diff_max" in record  # the old-log-prob pass ran (decoupled)
        assert math.isfinite(record["actor/pg_loss"])


def test_bypass_mode_trains_without_the_old_log_prob_pass(
    ray_session, tiny_model_dir, arithmetic_data, tmp_path
):
    metrics = _run(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        "bypass",
        **{
            "algorithm.rollout_correction.bypass_mode": True,
            "algorithm.rollout_correction.rollout_is": "token",
            "algorithm.rollout_correction.loss_type": "reinforce",
            # one optimizer step per training step: π_θ at the update is still π_rollout, so w = 1
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        },
    )
    for step in (1, 2):
        record = metrics[step]
        assert "timing_s/old_log_prob" not in record  # π_old is the rollout's: no forward
        assert record["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)  # from the loss
        assert math.isfinite(record["actor/pg_loss"]) and record["actor/grad_norm"] > 0
