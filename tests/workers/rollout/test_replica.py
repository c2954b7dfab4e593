"""Generation server replicas (:mod:`hybridflow.workers.rollout.replica`) and the agent loops' server
manager, over real engines on the tiny model: each engine is served from a thread of this process (as
a rank's worker serves it), its front door a real Ray actor."""

import asyncio
import threading
import time

import pytest
import ray
import torch
from omegaconf import OmegaConf

from hybridflow.workers.rollout.agent_loop import AsyncLLMServerManager, DictConfigWrap, SingleTurnAgentLoop
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.replica import LLMServer, ReplicaError, serve_requests

MAX_LEN = 96


class Replica:
    """A real engine on the tiny model, served from a thread until :meth:`close`."""

    def __init__(self, model_dir: str, name: str, wait_s: float = 0.05, start: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.engine = LLMEngine(
            EngineModel.from_hf_module(module, MAX_LEN),
            max_num_seqs=32,
            max_model_len=MAX_LEN,
            eos_token_ids=[],
        )
        self.server = ray.remote(num_cpus=0, max_concurrency=1000)(LLMServer).remote(name)
        defaults = SamplingParams(max_new_tokens=16, temperature=1.0)
        self.stats: dict = {}
        self.thread = threading.Thread(target=self._serve, args=(defaults, wait_s), daemon=True)
        if start:
            self.thread.start()

    def start(self) -> None:
        """Start serving (a replica made with ``start=False``: requests queue at its server until now)."""
        self.thread.start()

    def _serve(self, defaults, wait_s: float) -> None:
        with torch.no_grad():
            self.stats = serve_requests(self.engine, self.server, defaults, wait_s=wait_s)

    def close(self) -> dict:
        ray.get(self.server.stop_serving.remote())
        self.thread.join(timeout=30)
        return self.stats


@pytest.fixture(scope="module")
def replicas(ray_session, tiny_model_dir):
    served = [Replica(tiny_model_dir, f"replica {i}") for i in range(2)]
    yield served
    for replica in served:
        replica.close()


def _generate(server, request_id, prompt, **sampling):
    return server.generate.remote(request_id, prompt_ids=prompt, sampling_params=sampling)


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "condition not reached"
        time.sleep(0.005)


def test_concurrent_requests_share_the_running_batch(ray_session, tiny_model_dir):
    # the requests wait at the server before its engine serves (no race with their arrival): the
    # first exchange takes all 8, and every decode step then carries all of them
    replica = Replica(tiny_model_dir, "batch", start=False)
    try:
        refs = [
            _generate(replica.server, f"c{i}", [5 + i, 6, 7], max_tokens=16, ignore_eos=True)
            for i in range(8)
        ]
        _wait_until(lambda: ray.get(replica.server.in_flight.remote()) == 8)
        replica.start()
        outputs = ray.get(refs)
    finally:
        stats = replica.close()
    assert [len(o.token_ids) for o in outputs] == [16] * 8
    assert all(len(o.log_probs) == 16 and o.stop_reason == "length" for o in outputs)
    # 8 x 16 tokens one request at a time would take 8 x 15 decode steps; in one batch, 15
    assert replica.engine.stats["decode_steps"] == 15
    assert stats["requests"] == 8


def test_abort_returns_the_tokens_so_far(replicas, monkeypatch):
    engine, server = replicas[0].engine, replicas[0].server
    step = engine.step

    def slow_step():  # 80 tokens take >= 0.8 s: the abort (a few Ray hops) always lands mid-request
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    pending = _generate(server, "long", [9, 10, 11], max_tokens=80, ignore_eos=True)
    _wait_until(lambda: any(len(s.token_ids) >= 3 for s in list(engine._running)))
    ray.get(server.abort.remote("long"))
    output = ray.get(pending)
    assert output.stop_reason == "aborted"
    assert 3 <= len(output.token_ids) < 80 and len(output.log_probs) == len(output.token_ids)
    _wait_until(lambda: not engine.has_unfinished())


def test_a_request_without_logprobs_gets_none(replicas):
    """``rollout.calculate_log_probs=false`` in server mode: the agent loops ask with ``logprobs``
    false and the answer carries no log-probs (before, they came anyway and the batch had a
    ``rollout_log_probs`` column the setting had turned off)."""
    server = replicas[0].server
    asked, not_asked = ray.get(
        [
            _generate(server, "lp-1", [5, 6, 7], max_tokens=4, ignore_eos=True, logprobs=True),
            _generate(server, "lp-0", [5, 6, 7], max_tokens=4, ignore_eos=True, logprobs=False),
        ]
    )
    assert len(asked.log_probs) == 4
    assert len(not_asked.token_ids) == 4 and not_asked.log_probs is None


def test_a_bad_request_fails_alone_and_the_replica_keeps_serving(replicas):
    server = replicas[0].server
    with pytest.raises(ReplicaError, match=r"replica 0: prompt of 100 tokens leaves no room"):
        ray.get(_generate(server, "too-long", list(range(5, 105))))
    with pytest.raises(ReplicaError, match="unknown sampling_params"):
        ray.get(_generate(server, "odd", [5, 6], beam_width=4))
    assert len(ray.get(_generate(server, "fine", [5, 6], max_tokens=4, ignore_eos=True)).token_ids) == 4


def test_a_held_exchange_returns_with_the_first_request_and_outputs_go_one_way():
    """The server holds a busy engine's exchange until it has news (the engine keeps stepping), and the
    outputs that finish meanwhile reach their callers through :meth:`LLMServer.deliver`."""
    server = LLMServer("replica 9")

    async def run():
        held = asyncio.create_task(server.exchange([], idle=False, wait_s=5.0, hold=True))
        await asyncio.sleep(0.05)
        assert not held.done()  # nothing new: still held
        caller = asyncio.create_task(
            server.generate("a", prompt_ids=[5, 6], sampling_params={"max_tokens": 2})
        )
        reply = await asyncio.wait_for(held, 1.0)  # the request ends the hold at once
        assert [entry[0] for entry in reply["new"]] == ["a"] and not reply["stop"]
        quiet = await server.exchange([], idle=False, wait_s=0.05, hold=True)  # no news: the wait ends it
        assert quiet == {"new": [], "abort": [], "stop": False}
        server.deliver(
            [{"request_id": "a", "token_ids": [7, 8], "log_probs": [-0.1, -0.2], "finish_reason": "length"}]
        )
        return await asyncio.wait_for(caller, 1.0)

    output = asyncio.run(run())
    assert output.token_ids == [7, 8] and output.stop_reason == "length"


def test_the_serve_loop_exchanges_per_request_not_per_step(ray_session, tiny_model_dir):
    """Busy, the loop keeps one exchange held at the server instead of one per step: a burst of 8
    requests of 64 tokens takes far fewer exchanges than engine steps."""
    replica = Replica(tiny_model_dir, "replica 8", wait_s=0.5)
    try:
        outputs = ray.get(
            [_generate(replica.server, f"b{i}", [5 + i, 6], max_tokens=64, ignore_eos=True) for i in range(8)]
        )
    finally:
        stats = replica.close()
    assert [len(o.token_ids) for o in outputs] == [64] * 8
    assert stats["requests"] == 8 and stats["steps"] >= 60
    assert stats["exchanges"] < stats["steps"] / 4, stats  # one per 10 ms of steps before: ~steps / 2


def test_the_serve_loop_reports_its_prefix_cache_use_as_the_trainer_logs_it(ray_session, tiny_model_dir):
    """Turn 2 of a conversation (turn 1's prompt and answer, then a tool's tokens) finds turn 1's full
    blocks cached: the serve loop's stats count both turns' prompt tokens and the hits, and the agent
    loops' manager turns two replicas' stats into the synchronous rollout's metrics."""
    from hybridflow.workers.rollout.agent_loop.manager import _cache_metrics

    replica = Replica(tiny_model_dir, "replica cache")
    turn1 = list(range(5, 45))  # 40 tokens: 2 full blocks of 16
    try:
        first = ray.get(_generate(replica.server, "t1", turn1, max_tokens=8, ignore_eos=True))
        turn2 = turn1 + list(first.token_ids) + [7, 8, 9]  # 51 tokens: turn 1's 48 in 3 full blocks
        ray.get(_generate(replica.server, "t2", turn2, max_tokens=4, ignore_eos=True))
    finally:
        stats = replica.close()
    block = replica.engine.pool.block_size
    assert stats["prefix_queries"] == len(turn1) + len(turn2)
    assert stats["prefix_hits"] == (len(turn1) + len(first.token_ids) - 1) // block * block  # 32 here
    assert stats["preemptions"] == 0 and 0 < stats["kv_blocks_peak_frac"] <= 1
    other = {"prefix_queries": 100, "prefix_hits": 0, "preemptions": 2, "kv_blocks_peak_frac": 0.9}
    metrics = _cache_metrics([stats, other, {"requests": 0}])  # the last: a vLLM replica's stats
    assert metrics == {
        "rollout/prefix_cache_hit_rate": [stats["prefix_hits"] / (stats["prefix_queries"] + 100)],
        "rollout/preemptions": [2.0],
        "rollout/kv_blocks_peak_frac": [0.9],
    }


def test_a_failed_replica_raises_for_every_waiting_request(ray_session):
    server = ray.remote(num_cpus=0)(LLMServer).remote("replica 7 (rank 7)")  # no engine behind it
    pending = _generate(server, "stuck", [5, 6])
    ray.get(server.fail.remote("its engine process died"))
    for ref in (pending, _generate(server, "later", [5, 6])):
        with pytest.raises(ReplicaError, match=r"replica 7 \(rank 7\): its engine process died"):
            ray.get(ref)


def test_new_samples_go_to_the_least_busy_replica_and_their_turns_stick(replicas):
    manager = AsyncLLMServerManager({}, [r.server for r in replicas], names=["replica 0", "replica 1"])

    async def run():
        first = [
            manager.generate(
                f"s{i}", prompt_ids=[5, 6, i], sampling_params={"max_tokens": 12, "ignore_eos": True}
            )
            for i in range(6)
        ]
        await asyncio.gather(*first)
        chosen = {f"s{i}": manager._sticky[f"s{i}"] for i in range(6)}
        await manager.generate(
            "s0", prompt_ids=[5, 6, 0, 7], sampling_params={"max_tokens": 2}
        )  # a next turn
        return chosen

    chosen = asyncio.run(run())
    assert sorted(chosen.values()) == [0, 0, 0, 1, 1, 1]  # in flight together: spread evenly
    assert manager._sticky["s0"] == chosen["s0"]
    assert manager.sent[chosen["s0"]] == 4 and sum(manager.sent) == 7


def _single_turn_loop(server_manager, tokenizer, response_length: int = 24):
    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"response_length": response_length}}, "data": {}}
    )
    return SingleTurnAgentLoop(DictConfigWrap(config), server_manager, tokenizer)


def test_a_preempted_sample_resumes_exactly_like_an_uninterrupted_one(replicas, tiny_model_dir):
    """Partial rollout: abort mid-flight, resume from prompt + partial response — same tokens, masks and
    log-probs as the sample that ran through (its sampling stream continues where it stopped)."""
    from hybridflow.models.loading import load_tokenizer

    engine = replicas[1].engine
    manager = AsyncLLMServerManager({}, [replicas[1].server])
    tokenizer = load_tokenizer(tiny_model_dir)
    fields = {"raw_prompt_ids": [5, 6, 7, 8], "sample_id": "whole"}
    params = {"temperature": 1.0, "seed": 1234, "seed_sample": 1, "ignore_eos": True}
    # long enough that the abort lands mid-flight however fast the engine decodes (it takes effect an
    # exchange or two after it is sent: tens of milliseconds; a tiny model decodes a token in ~1 ms)
    length = MAX_LEN - 8

    async def run():
        whole = await _single_turn_loop(manager, tokenizer, length).run(params, **fields)
        task = asyncio.create_task(
            _single_turn_loop(manager, tokenizer, length).run(params, **{**fields, "sample_id": "cut"})
        )
        await asyncio.to_thread(
            _wait_until, lambda: any(len(s.token_ids) >= 5 for s in list(engine._running))
        )
        await manager.abort("cut")
        partial = await task
        resumed = await _single_turn_loop(manager, tokenizer, length).run(
            params, **{**fields, "partial_output": partial}
        )
        return whole, partial, resumed

    whole, partial, resumed = asyncio.run(run())
    assert partial.extra_fields["is_partial"] and 5 <= len(partial.response_ids) < length
    assert partial.metrics.num_preempted == 1
    assert not resumed.extra_fields["is_partial"] and resumed.metrics.num_preempted == 1
    assert resumed.response_ids == whole.response_ids and len(whole.response_ids) == length
    assert resumed.response_mask == whole.response_mask == [1] * length
    assert resumed.response_logprobs == pytest.approx(whole.response_logprobs, abs=1e-5)
    assert resumed.prompt_ids == whole.prompt_ids == [5, 6, 7, 8]
