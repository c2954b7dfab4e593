"""Scorers that hang off the main thread (the agent loops score each sample in a thread): a thread cannot
be killed, so the ones past their limit are counted, reported and bounded — they neither leak unseen nor
pile up (:mod:`hybridflow.workers.reward_manager.timeouts`)."""

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hybridflow.workers.reward_manager import NaiveRewardManager, timeouts
from hybridflow.workers.reward_manager.timeouts import ScorersStuck, ScoreTimeout, stuck_scorers
from tests.workers.reward_manager.test_reward_managers import make_batch

LIMIT = 3


@pytest.fixture
def bounded(monkeypatch):
    """A fresh count (other tests leave stuck threads behind) and a small bound."""
    monkeypatch.setattr(timeouts, "_stuck", {})
    monkeypatch.setattr(timeouts, "MAX_STUCK_SCORERS", LIMIT)


def _off_the_main_thread(call):
    box = {}

    def run():
        try:
            box["result"] = call()
        except BaseException as error:  # the test inspects it
            box["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return box


def test_stuck_scorer_threads_are_counted_warned_and_bounded(bounded, caplog):
    release = threading.Event()

    def hang():
        release.wait(60)
        return 1.0

    with caplog.at_level(logging.WARNING, logger=timeouts.__name__):
        for k in range(1, LIMIT + 1):
            box = _off_the_main_thread(
                lambda k=k: timeouts.call_with_time_limit(
                    hang, 0.05, "scorer timed out after 0.05s", describe=lambda k=k: f"sample {k}"
                )
            )
            assert isinstance(box.get("error"), ScoreTimeout)
            assert stuck_scorers() == k
    assert f"({LIMIT} stuck in this process, at most {LIMIT})" in caplog.text
    threads = threading.active_count()
    box = _off_the_main_thread(lambda: timeouts.call_with_time_limit(hang, 0.05, "timed out"))
    error = box.get("error")
    assert isinstance(error, ScorersStuck), box
    assert f"{LIMIT} scorer threads are stuck" in str(error) and "sample 1" in str(error)
    assert "reward_manager=prime" in str(error)
    assert threading.active_count() == threads, "a scorer thread was started past the bound"
    release.set()  # the stuck scorers return at last: they stop counting
    start = time.monotonic()
    while stuck_scorers():
        assert time.monotonic() - start < 10
        time.sleep(0.01)
    assert _off_the_main_thread(lambda: timeouts.call_with_time_limit(lambda: 2.0, 1.0, "x"))["result"] == 2.0


def hang_forever(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(3600)


def test_a_manager_that_zeroes_errors_still_stops_at_the_bound(bounded):
    """``on_score_error=zero`` scores a timed-out sample 0; the bound is not a scorer's error, so it
    passes through the manager and ends the run instead of zeroing every sample from then on."""
    from hybridflow.models.tiny import build_tokenizer
    from hybridflow.tasks.arithmetic import task_texts

    tokenizer = build_tokenizer(task_texts(n=300))
    data = make_batch(tokenizer, ["1"], ["1"])
    manager = NaiveRewardManager(
        tokenizer, 0, compute_score=hang_forever, score_timeout_s=0.05, on_score_error="zero"
    )
    for _ in range(LIMIT):
        box = _off_the_main_thread(lambda: manager(data, return_dict=True))
        assert box["result"]["reward_extra_info"]["timed_out"] == [1]
    box = _off_the_main_thread(lambda: manager(data, return_dict=True))
    assert isinstance(box.get("error"), ScorersStuck)


def test_the_agent_loop_worker_ends_on_stuck_scorers_naming_the_sample(bounded):
    """The agent-loop worker scores on a bounded pool of its own; the bound's error names the row."""
    from hybridflow.protocol import DataProto
    from hybridflow.workers.rollout.agent_loop.base import AgentLoopMetrics, AgentLoopOutput
    from hybridflow.workers.rollout.agent_loop.worker import SCORING_THREADS, AgentLoopError, AgentLoopWorker

    worker = object.__new__(AgentLoopWorker)
    worker.reward_fn = object()
    worker._scoring = ThreadPoolExecutor(SCORING_THREADS)
    worker._reward_clock = {"generated": 0.0, "scored": 0.0}  # what __init__ sets

    def score(batch, row, output):
        raise ScorersStuck("3 scorer threads are stuck")

    worker._score = score
    batch = DataProto.from_dict(non_tensors={"index": np.array([0, 41], dtype=object)})
    output = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], metrics=AgentLoopMetrics())
    with pytest.raises(AgentLoopError, match=r"row 1 \(dataset index 41\).*3 scorer threads are stuck"):
        asyncio.run(worker._maybe_score(batch, 1, output))
