"""main_ppo with reward_model.use_reward_loop=true and reward_model.enable=true: main_ppo serves the GenRM
judge (our engine behind ``python -m hybridflow.serve``) itself and an async custom reward function asks
it: GRPO steps scored after the rollout (colocated: the trainer's reward phase, the judge woken and put
back to sleep) and as each sample finishes (standalone, ``enable_resource_pool``: in the agent loops),
the same scores for the same samples, every sample judged, the judge stopped at the end: the issue's
three steps per mode (``STEPS``). benchmarks/reward_loop_modes.py compares the reward time left after the
rollout in the two modes. The fully-async run asks a judge served apart (its address in reward_kwargs)."""

import json
from pathlib import Path

import httpx
import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from hybridflow.trainer.ppo.workers_setup import build_worker_groups
from tests.tiny_run import as_overrides, tiny_run_values

JUDGE = str(Path(__file__).with_name("genrm_judge.py"))
STEPS = 3


@pytest.fixture(scope="module")
def judge(genrm):
    """The session's GenRM (conftest.py): two replicas behind the router."""
    return f"http://{genrm.address}"


def _config(model_dir, data, tmp: Path, name: str, standalone: bool):
    """main_ppo serves the judge itself (reward_model.enable with the loop): colocated, woken for the
    trainer's reward phase and asleep after it; standalone, its own replica scoring in the agent loops."""
    pool = {
        "reward_model.enable_resource_pool": True,
        "reward_model.nnodes": 1,
        "reward_model.n_gpus_per_node": 1,
    }
    values = tiny_run_values(
        model_dir,
        data,
        tmp / "ckpt",
        **{
            "trainer.experiment_name": name,
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": STEPS,
            "trainer.rollout_data_dir": str(tmp / "rollouts" / name),
            "actor_rollout_ref.rollout.mode": "async",
            "actor_rollout_ref.rollout.agent.num_workers": 2,  # standalone: two workers' metrics merged
            "reward_model.use_reward_loop": True,
            "reward_model.enable": True,
            "reward_model.model.path": model_dir,
            "reward_model.rollout.kv_cache_memory_gb": 0.01,
            "reward_model.rollout.max_num_seqs": 8,
            "reward_model.rollout.prompt_length": 64,
            "reward_model.rollout.response_length": 8,
            "reward_model.reward_manager": "limited",
            "reward_model.max_concurrent": 4,
            # verl's served name: the model's path
            "+custom_reward_function.reward_kwargs.judge_model": model_dir,
            "custom_reward_function.path": JUDGE,
            **(pool if standalone else {}),
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    return config


def _run_modes(modes, model_dir, data, tmp_path) -> tuple[dict, dict]:
    """main_ppo once per mode on one set of worker groups: (metrics by step, sorted rollout rows) per mode;
    each run's judge is checked stopped after it."""
    config = _config(model_dir, data, tmp_path, "wg", False)
    groups = build_worker_groups(config, use_critic=False, use_reference=False)
    records, rollouts = {}, {}
    try:
        for mode in modes:
            config = _config(model_dir, data, tmp_path, mode, mode == "standalone")
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(tmp_path)
                run_ppo(config, worker_groups=groups)
            metrics = tmp_path / "outputs" / "hybridflow" / mode / "metrics.jsonl"
            records[mode] = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines())}
            lines = (tmp_path / "rollouts" / mode / "1.jsonl").read_text().splitlines()
            rollouts[mode] = sorted((r["input"], r["output"], r["score"]) for r in map(json.loads, lines))
            address = config.reward_model.reward_kwargs.reward_router_address  # main_ppo's judge
            with pytest.raises(httpx.ConnectError):  # stopped at the run's end
                httpx.get(f"http://{address}/health", timeout=2)
    finally:
        groups.shutdown()
    for mode, steps in records.items():
        assert sorted(steps) == list(range(1, STEPS + 1)), mode
        for step in steps.values():
            assert step["reward/samples"] == 8 and step["reward/failures/error"] == 0  # all judged
            assert step["reward/judge_latency_p95_s"] > 0 and "reward/genrm/mean" in step
            assert step["reward/exposed_s"] >= 0
            # colocated: woken for the reward phase, asleep after it (its KV cache released)
            assert (step.get("reward/judge_freed_kv_gb", 0) > 0) == (mode == "colocated"), (mode, step)
    return records, rollouts


@pytest.mark.slow  # a whole run; its parts are checked in the fast tier (make test <= 15 min)
def test_main_ppo_serves_the_judge_colocated(ray_session, tiny_model_dir, arithmetic_data, tmp_path):
    _run_modes(["colocated"], tiny_model_dir, arithmetic_data, tmp_path)


@pytest.mark.slow  # make test-slow: two whole runs compared (the fast tier trains the colocated one)
def test_main_ppo_serves_the_judge_colocated_and_standalone(
    ray_session, tiny_model_dir, arithmetic_data, tmp_path
):
    _, rollouts = _run_modes(["colocated", "standalone"], tiny_model_dir, arithmetic_data, tmp_path)
    assert rollouts["colocated"] == rollouts["standalone"]  # same samples, same scores


@pytest.mark.slow  # a whole run; its parts are checked in the fast tier (make test <= 15 min)
def test_fully_async_scores_in_the_rollouters_stream(
    ray_session, vllm_model_dir, arithmetic_data, judge, tmp_path
):
    """fully_async_main with the reward loop: each sample judged in its agent loop inside the rollouter's
    stream (2 steps, on-policy), every one through the GenRM."""
    from hybridflow.trainer.fully_async.main import run_fully_async

    values = tiny_run_values(
        vllm_model_dir,
        arithmetic_data,
        tmp_path / "ckpt",
        **{
            "trainer.n_gpus_per_node": 1,
            "trainer.experiment_name": "fully_async",
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 2,
            "trainer.rollout_data_dir": str(tmp_path / "rollouts"),
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
            "async_training.staleness_threshold": 0,
            "async_training.trigger_parameter_sync_step": 1,
            "async_training.partial_rollout": False,
            "async_training.use_rollout_log_probs": False,
            "reward_model.use_reward_loop": True,
            "reward_model.reward_manager": "limited",
            "reward_model.max_concurrent": 4,
            "+reward_model.reward_kwargs.reward_router_address": judge.removeprefix("http://"),
            "+custom_reward_function.reward_kwargs.judge_model": "judge",
            "custom_reward_function.path": JUDGE,
        },
    )
    config = load_config(as_overrides(values), config_name="fully_async_ppo_trainer")
    before = sum(httpx.get(f"{judge}/router/stats").json()["sent"])
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        run_fully_async(config)
    judged = sum(httpx.get(f"{judge}/router/stats").json()["sent"]) - before
    rows = [json.loads(line) for step in (1, 2) for line in (tmp_path / "rollouts" / f"{step}.jsonl").open()]
    assert len(rows) == 2 * 8 and judged >= len(rows)  # every trained sample was judged in the stream
    assert all(row["score"] in (0.0, 1.0) for row in rows)
