"""reward_model.use_reward_loop and its keys: what runs is accepted, what nothing reads is refused before
Ray starts, with the key named."""

import pytest

from hybridflow.trainer.config import load_config
from hybridflow.trainer.config.honesty import honesty_problems


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
        (["reward_manager.source=importlib"], "read by the reward loop"),
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
        (["reward_model.use_reward_loop=true", "reward_model.enable=true"], "python -m hybridflow.serve"),
        (["reward_model.use_reward_loop=true", "reward_manager.source=importlib"], "module.path"),
    ],
)
def test_what_nothing_reads_is_refused(overrides, message):
    assert any(message in line for line in problems(*overrides)), problems(*overrides)
