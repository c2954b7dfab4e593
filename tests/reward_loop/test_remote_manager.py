"""verl's ``remote`` reward-loop manager: a sync scorer runs in Ray worker processes (not the test's),
round robin over ``reward_model.num_workers``, with the naive manager's scores; a scorer that hangs past
``score_timeout_s`` has its process killed and replaced (the sample scores 0 with ``timed_out``, the next
ones score); an async scorer is refused, at the manager and in the config check."""

import os
import textwrap

import pytest
from omegaconf import OmegaConf

from hybridflow.models.tiny import build_tokenizer
from hybridflow.tasks.arithmetic import task_texts
from hybridflow.trainer.config import load_config
from hybridflow.trainer.config.honesty import honesty_problems
from hybridflow.workers.reward_loop import RemoteRewardManager, RewardLoop
from tests.workers.reward_manager.test_reward_managers import make_batch

RESPONSES = ["3", "5", "answer 7", "", "4", "12"]
TRUTHS = ["3", "4", "7", "1", "4", "12"]

SCORERS = """
import asyncio
import os
import time

def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str == "hang":
        time.sleep(60)
    if solution_str.startswith("slow"):
        time.sleep(0.6)
    words = solution_str.strip().split()
    return {"score": float(words[-1:] == [ground_truth]), "pid": os.getpid()}

async def ascore(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 0.0
"""


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(task_texts(n=300))


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    path = tmp_path_factory.mktemp("remote") / "scorers.py"
    path.write_text(textwrap.dedent(SCORERS))
    return str(path)


def _config(scorers, manager="remote", name="score", **reward_model):
    return OmegaConf.create(
        {
            "reward_model": {
                "reward_manager": manager,
                "reward_kwargs": {},
                "num_workers": reward_model.pop("num_workers", 2),
                **reward_model,
            },
            "custom_reward_function": {"path": scorers, "name": name},
            "data": {"max_response_length": 8},
        }
    )


def test_remote_scores_in_worker_processes_as_naive_does(ray_session, tokenizer, scorers):
    batch = make_batch(tokenizer, RESPONSES, TRUTHS)
    remote = RewardLoop(_config(scorers, score_timeout_s=1.5, on_score_error="zero"), tokenizer)
    naive = RewardLoop(_config(scorers, "naive"), tokenizer)
    assert isinstance(remote.manager, RemoteRewardManager)
    out, expected = remote(batch, return_dict=True), naive(batch, return_dict=True)
    assert out["reward_tensor"].equal(expected["reward_tensor"])
    assert out["reward_tensor"].sum(-1).tolist() == [1, 0, 1, 0, 1, 1]  # by hand: the last word
    pids = set(out["reward_extra_info"]["pid"])
    assert len(pids) == 2 and os.getpid() not in pids  # both processes, never this one
    assert expected["reward_extra_info"]["pid"] == [os.getpid()] * 6  # naive: a thread here
    # one sample per process (round robin): the hung one's process is killed at 1.5 s, the other scores
    scored = remote(make_batch(tokenizer, ["hang", "3"], ["1", "3"]), return_dict=True)
    assert scored["reward_tensor"].sum(-1).tolist() == [0, 1]
    assert scored["reward_extra_info"]["timed_out"] == [1, 0]
    again = remote(make_batch(tokenizer, ["3", "4"], ["3", "4"]), return_dict=True)
    assert again["reward_tensor"].sum(-1).tolist() == [1, 1]
    assert len(set(again["reward_extra_info"]["pid"]) - pids) == 1  # the killed process was replaced


def test_an_async_scorer_is_refused(scorers, tokenizer):
    with pytest.raises(ValueError, match="async compute_score is not supported"):
        RewardLoop(_config(scorers, name="ascore"), tokenizer)  # refused before any process starts
    overrides = [
        "reward_model.use_reward_loop=true",
        "reward_model.reward_manager=remote",
        f"custom_reward_function.path={scorers}",
        "custom_reward_function.name=ascore",
    ]
    assert any("async def" in p for p in honesty_problems(load_config(overrides)))
    assert not any(
        "num_workers" in p for p in honesty_problems(load_config([*overrides, "reward_model.num_workers=3"]))
    )


def test_a_call_waiting_for_the_process_is_not_timed_out(ray_session, tokenizer, scorers):
    """One process, five 0.6 s calls, a 1.5 s limit: each call's limit starts when the process takes it.
    Before, all five were submitted at once and timed from then: the third (1.8 s) timed out, its process
    was killed, and the two queued behind it failed with it."""
    batch = make_batch(tokenizer, [f"slow {i}" for i in range(5)], [str(i) for i in range(5)])
    loop = RewardLoop(_config(scorers, num_workers=1, score_timeout_s=1.5, on_score_error="zero"), tokenizer)
    import time

    start = time.perf_counter()
    out = loop(batch, return_dict=True)
    assert time.perf_counter() - start >= 5 * 0.6  # one process: the calls ran one after another
    assert out["reward_tensor"].sum(-1).tolist() == [1.0] * 5
    assert not any(out["reward_extra_info"].get("timed_out", [0] * 5))
    assert len(set(out["reward_extra_info"]["pid"])) == 1  # never killed and replaced
