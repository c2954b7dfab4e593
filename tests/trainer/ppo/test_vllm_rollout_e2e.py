"""``rollout.name=vllm`` end to end: GRPO through ``run_ppo`` with vLLM in each actor rank's process
(verl's hybrid mode), weights synced in place every step, log-probs checked against the actor's
recompute every step — including after the first update, on a model with tied embeddings (where a
stale packed LM head would hide)."""

import json
import math

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from tests.tiny_run import as_overrides, tiny_run_values
from tests.vllm_support import requires_vllm

pytestmark = requires_vllm


def test_grpo_on_vllm_two_ranks_with_validation(ray_session, vllm_model_dir, arithmetic_data, tmp_path):
    values = tiny_run_values(
        vllm_model_dir,
        arithmetic_data,
        tmp_path / "ckpt",
        **{
            "actor_rollout_ref.rollout.name": "vllm",
            "actor_rollout_ref.rollout.enforce_eager": True,  # no inductor compile at start-up in tests
            "actor_rollout_ref.rollout.kv_cache_memory_gb": 0.0625,
            "actor_rollout_ref.actor.optim.lr": 1e-2,
            "actor_rollout_ref.actor.entropy_coeff": 0.01,  # a gradient even where rewards tie
            "trainer.total_training_steps": 2,
            "trainer.val_before_train": True,
            "trainer.test_freq": 2,
            "trainer.experiment_name": "vllm",
            "trainer.resume_mode": "disable",
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        run_ppo(config)
    lines = (tmp_path / "outputs" / "hybridflow" / "vllm" / "metrics.jsonl").read_text().splitlines()
    metrics = {record["step"]: record for record in map(json.loads, lines)}
    assert sorted(metrics) == [0, 1, 2]
    assert "val-core/hybridflow/arithmetic/reward/mean@1" in metrics[0]
    assert "val-core/hybridflow/arithmetic/reward/mean@1" in metrics[2]
    for step in (1, 2):  # step 2 samples from the weights synced after step 1's update
        record = metrics[step]
        assert record["training/rollout_log_probs_diff_max"] <= 1e-3, record[
            "training/rollout_log_probs_diff_max"
        ]
        assert "training/rollout_probs_diff_max" in record
        assert math.isfinite(record["actor/pg_loss"])
    assert metrics[2]["timing_s/update_weights"] > 0  # the sync after step 1's update
    assert metrics[1]["actor/grad_norm"] > 0  # step 1's update changed the weights step 2 samples from


def test_lora_with_multi_turn_tools_on_vllm(ray_session, vllm_model_dir, arithmetic_data, tmp_path):
    """A LoRA actor hands vLLM merged weights (vLLM runs no adapters here), and the multi-turn tool loop
    drives vLLM by token ids: the rollout's log-probs still equal the peft actor's after an update."""
    from pathlib import Path

    tools = Path(__file__).parents[3] / "examples" / "tools" / "gsm8k_tool_config.yaml"
    values = tiny_run_values(
        vllm_model_dir,
        arithmetic_data,
        tmp_path / "ckpt",
        **{
            "actor_rollout_ref.rollout.name": "vllm",
            "actor_rollout_ref.rollout.enforce_eager": True,  # no inductor compile at start-up in tests
            "actor_rollout_ref.rollout.kv_cache_memory_gb": 0.0625,
            "trainer.n_gpus_per_node": 1,
            "actor_rollout_ref.model.lora_rank": 8,
            "actor_rollout_ref.model.lora_alpha": 16,
            "actor_rollout_ref.actor.optim.lr": 1e-2,
            "actor_rollout_ref.actor.entropy_coeff": 0.01,
            "data.max_response_length": 24,
            "actor_rollout_ref.rollout.multi_turn.enable": True,
            "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(tools),
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
            "trainer.total_training_steps": 2,
            "trainer.experiment_name": "vllm_lora_tools",
            "trainer.resume_mode": "disable",
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        run_ppo(config)
    lines = (
        (tmp_path / "outputs" / "hybridflow" / "vllm_lora_tools" / "metrics.jsonl").read_text().splitlines()
    )
    metrics = {record["step"]: record for record in map(json.loads, lines)}
    assert metrics[1]["actor/grad_norm"] > 0
    assert metrics[2]["training/rollout_log_probs_diff_max"] <= 1e-3
    for key in ("num_turns/mean", "tool_calls/mean", "tool_failures/mean"):
        assert math.isfinite(metrics[2][key]), key
    assert metrics[2]["num_turns/min"] >= 1
