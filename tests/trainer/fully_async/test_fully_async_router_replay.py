"""Router replay R3 through ``fully_async_main`` (issue 48 item 3, end to end): a tiny Qwen3-MoE, the rollout
pool's engine recording each token's experts, the trainer's actor replaying them in its old-log-prob recompute
and its update, with staleness 1 and partial rollout (aborted samples resumed: their record is the resumed
request's, which covers the whole sample). Every replaying forward raises without ``routed_experts`` or with
ids of another shape, so finishing is the check that they travelled; every sync's probe (the trainer's
actor replaying the probe's ids) stays within the fp32 gap. The parts: ``tests/workers/rollout/
test_server_routed_experts.py``."""

import math

import pytest

from tests.trainer.fully_async.test_fully_async_e2e import (  # noqa: F401  (mixed_length_data: a fixture)
    _metrics,
    _pause_mid_generation,
    _run_fully_async,
    _values,
    mixed_length_data,
)
from tests.trainer.ppo.test_moe_router_replay_main_ppo import moe_model_dir  # noqa: F401  (fixture)


@pytest.mark.slow  # a whole fully-async run on Ray with partial rollouts
def test_fully_async_trains_an_moe_with_r3_through_partial_rollouts(
    ray_session,
    moe_model_dir,  # noqa: F811
    mixed_length_data,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    # every sample waits 3 s before it generates and every sync's pause waits for a request in flight, so
    # some sync aborts samples mid-generation however fast this machine decodes (test_fully_async_e2e)
    loop = "tests.workers.rollout.verl_style_agent_loops.SlowSingleTurnAgentLoop"
    (tmp_path / "loops.yaml").write_text(f"- name: slow\n  _target_: {loop}\n  delay_s: 3.0\n  every: 1\n")
    aborted = _pause_mid_generation(monkeypatch)
    values = _values(
        moe_model_dir,
        mixed_length_data,
        tmp_path,
        "moe_r3",
        **{
            "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
            "actor_rollout_ref.actor.router_replay.mode": "R3",
            "async_training.staleness_threshold": 1,
            "async_training.partial_rollout": True,
            "async_training.use_rollout_log_probs": False,
            "trainer.total_training_steps": 4,
            "data.max_response_length": 96,
            "actor_rollout_ref.rollout.ignore_eos": True,  # long samples: a sync lands while they run
            "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(tmp_path / "loops.yaml"),
            "actor_rollout_ref.rollout.agent.default_agent_loop": "slow",
        },
    )
    _run_fully_async(values, tmp_path)
    assert any(aborted), aborted  # some sync did find requests in flight
    metrics = _metrics(tmp_path, "moe_r3")
    assert sorted(metrics) == [1, 2, 3, 4]
    for record in metrics.values():
        for key in ("actor/pg_loss", "actor/grad_norm", "fully_async/partial/partial_ratio"):
            assert math.isfinite(record[key]), key
        assert record["fully_async/param_sync/probe_gap_max"] <= 1e-2
    assert any(record["fully_async/partial/partial_ratio"] > 0 for record in metrics.values())  # resumed
