"""Router replay R3 through ``main_ppo`` (issue 48 item 3, end to end): a tiny Qwen3-MoE takes 2 GRPO steps on
Ray with the embedded engine recording each token's experts (``rollout.enable_rollout_routing_replay``), the
actor's old-log-prob pass and its update (two mini-batches a step) and the reference
(``ref.router_replay.mode=R3``) replaying them. Every forward that replays needs ``routed_experts`` in its
batch (it raises without), so finishing both steps is the check that the ids travelled; the losses are
finite and the rollout's log-probs stay at the fp32 engine's parity with the replaying actor. Both in the sync
rollout and in server mode (``rollout.mode=async``: the replicas' answers carry the ids, the agent loops'
worker lays them out)."""

import json
import math

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from tests.tiny_run import as_overrides, tiny_run_values


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from hybridflow.models.tiny import build_tiny_model

    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("moe_model") / "model",
            arch="qwen3_moe",
            hidden_size=64,
            num_layers=2,
            intermediate_size=64,
        )
    )


@pytest.mark.slow  # a whole run on Ray; its parts: tests/workers/test_router_replay.py and the engine's
@pytest.mark.parametrize("mode", ["sync", "async"])  # async: agent loops on server replicas (server mode)
def test_qwen3_moe_trains_two_grpo_steps_with_r3(
    ray_session, moe_model_dir, arithmetic_data, tmp_path, monkeypatch, mode
):
    monkeypatch.chdir(tmp_path)
    values = tiny_run_values(
        moe_model_dir,
        arithmetic_data,
        **{
            "algorithm.adv_estimator": "grpo",
            "actor_rollout_ref.rollout.name": "engine",
            "actor_rollout_ref.rollout.mode": mode,
            "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
            "actor_rollout_ref.actor.router_replay.mode": "R3",
            "actor_rollout_ref.ref.router_replay.mode": "R3",
            "actor_rollout_ref.actor.use_kl_loss": True,
            "actor_rollout_ref.actor.entropy_coeff": 0.01,
            "actor_rollout_ref.actor.optim.lr": 1e-2,
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 2,
            "trainer.save_freq": -1,
            "trainer.experiment_name": "moe_r3",
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    run_ppo(config)
    lines = (tmp_path / "outputs" / "hybridflow" / "moe_r3" / "metrics.jsonl").read_text().splitlines()
    metrics = {record["step"]: record for record in map(json.loads, lines)}
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
            assert math.isfinite(metrics[step][key]), (step, key)
        assert metrics[step]["training/rollout_log_probs_diff_max"] < 1e-3, step
    assert metrics[1]["actor/grad_norm"] > 0
