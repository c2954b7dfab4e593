"""A GenRM on our engine, two ``python -m hybridflow.serve`` replicas behind ``python -m
hybridflow.serve.router``: an async reward function scores a batch through the router's address, the
requests spread over both replicas (least in flight), and the scores are the function's."""

import httpx
import pytest
from omegaconf import OmegaConf

from hybridflow.serve.router import LeastInFlight
from hybridflow.workers.reward_loop import RewardLoop
from tests.reward_loop.test_reward_loop_e2e import JUDGE
from tests.workers.reward_manager.test_reward_managers import make_batch


def test_least_in_flight_picks_the_idle_replica_then_the_least_used():
    policy = LeastInFlight(["a", "b", "c"])
    assert [policy.acquire() for _ in range(3)] == [0, 1, 2]
    policy.release(1)
    assert policy.acquire() == 1  # the only one with nothing in flight
    policy.release(0), policy.release(1), policy.release(2)
    assert policy.acquire() == 0  # all idle: 0 and 2 sent once, 1 twice -> 0


def test_a_genrm_scores_through_the_router(tiny_model_dir, genrm):
    from hybridflow.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    responses, truths = ["3", "5", "7", "2", "10", "4", "6", "9"], ["3", "4", "7", "1", "10", "5", "6", "9"]
    batch = make_batch(tokenizer, responses, truths)
    config = OmegaConf.create(
        {
            "reward_model": {"reward_manager": "naive", "reward_kwargs": {}},
            "custom_reward_function": {
                "path": JUDGE,
                "name": "compute_score",
                "reward_kwargs": {"judge_model": "judge"},  # verl: the function's own arguments
            },
        }
    )
    before = httpx.get(f"http://{genrm.address}/router/stats").json()["sent"]
    loop = RewardLoop(config, tokenizer, reward_router_address=genrm.address)
    out = loop(batch, return_dict=True)
    after = httpx.get(f"http://{genrm.address}/router/stats").json()["sent"]
    sent = [a - b for a, b in zip(after, before, strict=True)]
    assert loop.source == "genrm" and all(out["reward_extra_info"]["verdict_chars"])
    assert out["reward_tensor"].sum(-1).tolist() == [float(r == t) for r, t in zip(responses, truths)]
    assert sum(sent) == 8 and min(sent) >= 1, sent  # both replicas judged
    metrics = loop.pop_metrics()
    assert metrics["reward/genrm/mean"] == pytest.approx(5 / 8) and metrics["reward/judge_latency_p50_s"] > 0
