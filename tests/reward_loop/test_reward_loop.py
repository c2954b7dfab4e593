"""The reward loop: sync and async reward functions give the same scores (and the batch managers' rule
scores), the rate-limited manager's token bucket and semaphore hold, and a judge that hangs, returns
garbage or 500s is scored 0 with verl's extras and counted."""

import asyncio
import logging
import textwrap
import time

import pytest
from omegaconf import OmegaConf

from hybridflow.models.tiny import build_tokenizer
from hybridflow.tasks.arithmetic import task_texts
from hybridflow.workers.reward_loop import (
    AsyncTokenBucket,
    RateLimitedRewardManager,
    RewardLoop,
    is_async_function,
    manager_class,
)
from hybridflow.workers.reward_manager import build_reward_manager
from tests.reward_loop.support import BadJudge
from tests.workers.reward_manager.test_reward_managers import make_batch

RESPONSES = ["3", "5", "answer 7", "", "4", "12"]
TRUTHS = ["3", "4", "7", "1", "4", "12"]

SCORERS = """
import asyncio

def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(solution_str.strip().split()[-1:] == [ground_truth]) if solution_str.strip() else 0.0

async def ascore(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(0.01)
    return score(data_source, solution_str, ground_truth, extra_info)

async def judge(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    from hybridflow.utils.served_client import chat_complete
    request = {"model": "judge", "messages": [{"role": "user", "content": solution_str}]}
    result = await chat_complete(extra_info["judge"], request, max_retries=int(extra_info.get("retries", 0)),
                                 timeout_s=extra_info.get("timeout_s", 5), backoff_s=0.01)
    verdict = result.choices[0].message.content
    return {"score": float(verdict == "correct"), "verdict": verdict}
"""


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(task_texts(n=300))


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    path = tmp_path_factory.mktemp("scorers") / "scorers.py"
    path.write_text(textwrap.dedent(SCORERS))
    return str(path)


@pytest.fixture(autouse=True)
def fresh_limiters():
    RateLimitedRewardManager.reset_class()
    yield
    RateLimitedRewardManager.reset_class()


def config(scorers=None, name="score", **reward_model):
    custom = {"path": scorers, "name": name} if scorers else {"path": None, "name": "compute_score"}
    return OmegaConf.create(
        {
            "reward_model": {"reward_manager": "naive", "reward_kwargs": {}, **reward_model},
            "custom_reward_function": custom,
            "data": {"max_response_length": 8},
        }
    )


def test_sync_and_async_functions_score_the_same_as_the_batch_manager(tokenizer, scorers):
    batch = make_batch(tokenizer, RESPONSES, TRUTHS)
    sync_loop = RewardLoop(config(scorers, "score"), tokenizer)
    async_loop = RewardLoop(config(scorers, "ascore"), tokenizer)
    assert not sync_loop.manager.is_async_reward_score and async_loop.manager.is_async_reward_score
    sync_out = sync_loop(batch, return_dict=True)
    async_out = async_loop(batch, return_dict=True)
    cfg = config(scorers, "score")
    batch_manager = build_reward_manager(
        cfg.reward_model, cfg.custom_reward_function, tokenizer, num_examine=0
    )
    expected = batch_manager(batch)
    assert expected.sum(-1).tolist() == [1, 0, 1, 0, 1, 1]  # by hand: the last word equals the truth
    for out in (sync_out, async_out):
        assert out["reward_tensor"].equal(expected)
        assert out["reward_extra_info"]["acc"] == expected.sum(-1).tolist()


def test_rule_scores_are_the_same_with_the_loop_on_and_off(tokenizer):
    """No custom function: the data source's rule scorer, through the loop and through the batch manager."""
    batch = make_batch(tokenizer, RESPONSES, TRUTHS)
    cfg = config()
    loop = RewardLoop(cfg, tokenizer)
    off = build_reward_manager(cfg.reward_model, cfg.custom_reward_function, tokenizer, num_examine=0)(batch)
    assert loop(batch).equal(off) and off.abs().sum() > 0
    assert loop.source == "rule"
    metrics = loop.pop_metrics()
    assert metrics["reward/samples"] == 6 and metrics["reward/rule/mean"] == pytest.approx(
        off.sum().item() / 6
    )


def test_async_detection():
    async def a(**kw):
        return 1.0

    class Judge:
        async def __call__(self, **kw):
            return 1.0

    import functools

    assert is_async_function(a) and is_async_function(functools.partial(a)) and is_async_function(Judge())
    assert not is_async_function(lambda **kw: 1.0)


def test_verl_top_level_reward_manager_section(tmp_path):
    assert manager_class({"reward_model": {"reward_manager": "limited"}}) is RateLimitedRewardManager
    assert (
        manager_class({"reward_manager": {"source": "register", "name": "rate_limited"}})
        is RateLimitedRewardManager
    )
    module = tmp_path / "mine.py"
    module.write_text(
        "from hybridflow.workers.reward_loop import NaiveRewardManager\n"
        "class Mine(NaiveRewardManager):\n    pass\n"
    )
    section = {"source": "importlib", "name": "Mine", "module": {"path": str(module), "name": "mine_module"}}
    cls = manager_class({"reward_manager": section})  # verl's: the class is name, module.name the module's
    assert cls.__name__ == "Mine"
    with pytest.raises(KeyError, match="Registered:.*rate_limited"):
        manager_class({"reward_model": {"reward_manager": "nope"}})


def test_token_bucket_rate_holds_within_10_percent_over_5_s():
    """20 tokens/s, a burst of 1: 200 concurrent takers; in 5 s 1 + 20 * 5 = 101 get through (within 10%).
    The window is the one measured: on a loaded machine the 5-s sleep may wake late, and the takers
    that got through meanwhile are counted against the longer window."""

    async def run():
        bucket = AsyncTokenBucket(rate_limit=20.0, max_tokens=1.0)
        done = []

        async def take():
            await bucket.acquire(1.0)
            done.append(time.monotonic())

        start = time.monotonic()
        tasks = [asyncio.create_task(take()) for _ in range(200)]
        await asyncio.sleep(5.0)
        window = time.monotonic() - start
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return [t - start for t in done if t - start <= window], window

    times, window = asyncio.run(run())
    expected = 1 + 20 * window
    assert expected * 0.9 <= len(times) <= expected * 1.1, (len(times), window)


def test_large_requests_go_into_debt_and_wait_the_shortfall():
    async def run():
        bucket = AsyncTokenBucket(rate_limit=100.0, max_tokens=10.0)
        start = time.monotonic()
        await bucket.acquire(30.0)  # 10 there, 20 short: 0.2 s
        first = time.monotonic() - start
        await bucket.acquire(5.0)  # the debt (-20) refilled during that wait; 5 more: 0.05 s
        return first, time.monotonic() - start

    first, total = asyncio.run(run())
    assert first == pytest.approx(0.2, abs=0.06) and total == pytest.approx(0.25, abs=0.06)


def test_a_burst_of_1000_samples_stays_within_max_concurrent(tokenizer, tmp_path):
    """1,000 rows handed in at once; the scorer records how many calls run together: never above 4."""
    path = tmp_path / "counting.py"
    path.write_text(
        "import asyncio\nstate = {'now': 0, 'peak': 0, 'calls': 0}\n"
        "async def score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    state['now'] += 1; state['calls'] += 1; state['peak'] = max(state['peak'], state['now'])\n"
        "    await asyncio.sleep(0.001)\n    state['now'] -= 1\n    return 1.0\n"
    )
    loop = RewardLoop(config(str(path), reward_manager="limited", max_concurrent=4, timeout=30), tokenizer)
    batch = make_batch(tokenizer, ["1"] * 1000, ["1"] * 1000)
    reward = loop(batch)
    state = loop.manager.compute_score.target().__globals__["state"]
    assert reward.sum().item() == 1000 and state["calls"] == 1000
    assert state["peak"] == 4


@pytest.mark.parametrize(("mode", "kind"), [("hang", "timeout"), ("garbage", "error"), ("500", "error")])
def test_a_judge_that_fails_is_scored_zero_and_counted(tokenizer, scorers, mode, kind, caplog):
    judge = BadJudge(mode)
    try:
        limit = 0.5 if mode == "hang" else 10.0  # a loaded machine must not turn garbage into a timeout
        cfg = config(scorers, "judge", reward_manager="limited", max_concurrent=8, timeout=limit)
        loop = RewardLoop(cfg, tokenizer)
        batch = make_batch(tokenizer, ["1", "2", "3"], ["1", "2", "3"])
        batch.non_tensor_batch["extra_info"][:] = [{"judge": judge.address, "timeout_s": 5}] * 3
        with caplog.at_level(logging.WARNING):
            out = loop(batch, return_dict=True)
    finally:
        judge.close()
    assert out["reward_tensor"].abs().sum() == 0
    extras = out["reward_extra_info"]
    assert extras["acc"] == [0.0] * 3
    assert (extras["timeout"] == [True] * 3) if kind == "timeout" else all(extras["error"])
    metrics = loop.pop_metrics()
    assert metrics[f"reward/failures/{kind}"] == 3 and metrics["reward/retries"] == 0
    logged = [r for r in caplog.records if "later" in r.getMessage()]
    assert len(logged) == 1  # the first failure of its kind, not all three


def test_a_flaky_judge_is_retried_only_when_configured(tokenizer, scorers):
    judge = BadJudge("flaky", failures=2, content="correct")  # the first call of each run: 503
    try:
        batch = make_batch(tokenizer, ["1"], ["1"])
        batch.non_tensor_batch["extra_info"][:] = [{"judge": judge.address}]
        off = RewardLoop(config(scorers, "judge", reward_manager="limited", timeout=5), tokenizer)
        assert off(batch, return_dict=True)["reward_extra_info"]["error"][0]  # 503, no retry: 0.0 + error
        RateLimitedRewardManager.reset_class()
        on = RewardLoop(
            config(scorers, "judge", reward_manager="limited", timeout=5, max_retries=1), tokenizer
        )
        out = on(batch, return_dict=True)
    finally:
        judge.close()
    assert out["reward_tensor"].sum() == 1 and out["reward_extra_info"]["verdict"] == ["correct"]
    metrics = on.pop_metrics()
    assert metrics["reward/retries"] == 1 and metrics["reward/failures/error"] == 0
    assert metrics["reward/judge_latency_p95_s"] >= metrics["reward/judge_latency_p50_s"] > 0


def test_the_limited_manager_serves_two_loops_in_one_process(tokenizer, scorers):
    """The trainer holds a training and a validation RewardLoop, each on its own event loop (and a second
    run in the same process makes more): the shared limiters follow the loop that uses them."""
    batch = make_batch(tokenizer, RESPONSES, TRUTHS)
    cfg = config(scorers, "ascore", reward_manager="limited", max_concurrent=1)
    first, second = RewardLoop(cfg, tokenizer), RewardLoop(cfg, tokenizer)
    for loop in (first, second, first):
        assert loop(batch).sum(-1).tolist() == [1, 0, 1, 0, 1, 1]


def test_worker_metrics_merge_weighted_by_samples():
    """Two agent-loop workers: 3 samples scoring mean 1.0 and 1 sample scoring 0.0 give 0.75 over the
    4 (before: 0.5, the plain mean of the two workers); counts sum; p95 is the larger worker's."""
    from hybridflow.workers.reward_loop.loop import merge_worker_metrics

    merged = merge_worker_metrics(
        [
            {"reward/rule/mean": 1.0, "reward/samples": 3.0, "reward/judge_latency_p95_s": 0.2},
            {"reward/rule/mean": 0.0, "reward/samples": 1.0, "reward/judge_latency_p95_s": 0.9},
        ],
        [],
    )
    assert merged["reward/rule/mean"] == 0.75
    assert merged["reward/samples"] == 4.0
    assert merged["reward/judge_latency_p95_s"] == 0.9
