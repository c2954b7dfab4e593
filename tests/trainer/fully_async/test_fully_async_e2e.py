"""``python -m hybridflow.trainer.fully_async_main`` end to end on the tiny model (a trainer pool of one
process, a rollout pool of one):

- staleness 0 with a sync every step is on-policy: it equals synchronous ``main_ppo`` step by step —
  same prompts, same sampled tokens (each sample draws from its own stream), same scores and losses;
- staleness 1 with partial rollout and token-level IS runs, keeps every sample's version gap within the
  bound and reports ``fully_async/*`` and ``rollout_corr/*``.
"""

import json
import math

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from tests.tiny_run import as_overrides, tiny_run_values

COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm")


def _values(model_dir, data, tmp, name, **extra) -> dict:
    return tiny_run_values(
        model_dir,
        data,
        tmp / "ckpt",
        **{
            "trainer.n_gpus_per_node": 1,
            "trainer.experiment_name": name,
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 3,
            "trainer.rollout_data_dir": str(tmp / "rollouts" / name),
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
            "actor_rollout_ref.actor.optim.lr": 1e-2,
            "actor_rollout_ref.actor.entropy_coeff": 0.01,
            "data.max_response_length": 8,
            **extra,
        },
    )


def _metrics(tmp, name) -> dict[int, dict]:
    lines = (tmp / "outputs" / "hybridflow" / name / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def _rollouts(tmp, name, step) -> list[tuple]:
    rows = [json.loads(line) for line in (tmp / "rollouts" / name / f"{step}.jsonl").read_text().splitlines()]
    return sorted((row["input"], row["output"], row["score"]) for row in rows)


def _run_fully_async(values: dict, tmp):
    from hybridflow.trainer.fully_async.main import run_fully_async

    config = load_config(as_overrides(values), config_name="fully_async_ppo_trainer")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        run_fully_async(config)


def test_staleness_zero_with_a_sync_every_step_equals_main_ppo(
    ray_session, vllm_model_dir, arithmetic_data, tmp_path
):
    from hybridflow.trainer.main_ppo import run_ppo

    sync = load_config(
        as_overrides(
            _values(vllm_model_dir, arithmetic_data, tmp_path, "sync", **{"data.train_batch_size": 4})
        )
    )
    OmegaConf.resolve(sync)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        run_ppo(sync)
    on_policy = {
        "async_training.staleness_threshold": 0,
        "async_training.trigger_parameter_sync_step": 1,
        "async_training.partial_rollout": False,
        "async_training.use_rollout_log_probs": False,  # old log-probs recomputed, as main_ppo's
    }
    _run_fully_async(_values(vllm_model_dir, arithmetic_data, tmp_path, "fully_async", **on_policy), tmp_path)
    sync_metrics, async_metrics = _metrics(tmp_path, "sync"), _metrics(tmp_path, "fully_async")
    for step in (1, 2, 3):
        assert _rollouts(tmp_path, "fully_async", step) == _rollouts(tmp_path, "sync", step)
        for key in COMPARED:
            assert async_metrics[step][key] == pytest.approx(sync_metrics[step][key], rel=1e-6, abs=1e-7), (
                step,
                key,
            )
        assert async_metrics[step]["fully_async/staleness/max"] == 0.0
    assert async_metrics[3]["fully_async/count/current_param_version"] == 2  # synced after steps 1 and 2


def test_stale_partial_rollouts_with_token_is(ray_session, vllm_model_dir, arithmetic_data, tmp_path):
    values = _values(
        vllm_model_dir,
        arithmetic_data,
        tmp_path,
        "stale",
        **{
            "async_training.staleness_threshold": 1,
            "async_training.partial_rollout": True,
            "async_training.use_rollout_log_probs": False,
            "algorithm.rollout_correction.rollout_is": "token",
            "trainer.total_training_steps": 4,
            "data.max_response_length": 24,
            "actor_rollout_ref.rollout.ignore_eos": True,  # long samples: a sync lands while they run
        },
    )
    _run_fully_async(values, tmp_path)
    metrics = _metrics(tmp_path, "stale")
    assert sorted(metrics) == [1, 2, 3, 4]
    for record in metrics.values():
        assert record["fully_async/staleness/max"] <= 1  # ceil(staleness_threshold)
        for key in (
            "fully_async/count/total_generated_samples",
            "fully_async/partial/partial_ratio",
            "fully_async/trainer/idle_ratio",
            "rollout_corr/rollout_is_mean",
            "rollout_corr/kl",
        ):
            assert math.isfinite(record[key]), key
    assert any(record["fully_async/staleness/max"] == 1 for record in metrics.values())  # it did run ahead
    assert metrics[4]["timing_s/param_sync"] > 0
