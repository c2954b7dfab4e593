"""Decoding several steps on the device between reads back (``decode_steps_per_sync``, the GPU's
setting; checked here on the CPU): the same greedy and seeded tokens as step by step, one host read
per burst, limits kept, and the cases that must stay step by step."""

import pytest
import torch

from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.engine_rollout import decode_steps_per_sync
from tests.workers.rollout.test_engine import EOS, _prompts, _random_model

STOPS = (5, 11, 17)  # frequent stop tokens: sequences end at many different steps within bursts


@pytest.fixture(scope="module")
def model():
    return _random_model("qwen2")


def _engine(model, per_sync: int, slots: int = 32, max_len: int = 48) -> LLMEngine:
    return LLMEngine(
        EngineModel.from_hf_module(model, max_len),
        slots,
        max_len,
        eos_token_ids=[EOS],
        decode_steps_per_sync=per_sync,
    )


def _generate(model, per_sync: int, params: SamplingParams, n: int = 2, **engine_kwargs):
    engine = _engine(model, per_sync, **engine_kwargs)
    results = engine.generate_batch(_prompts(12, seed=3), params, n=n)
    return [c for r in results for c in r.completions], engine.stats


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=30, do_sample=False, stop_token_ids=STOPS),
        SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, stop_token_ids=STOPS, seed=7),
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("per_sync", [3, 8])
def test_bursts_give_the_step_by_step_tokens_with_one_read_each(model, params, per_sync):
    steps, step_stats = _generate(model, 1, params)
    burst, burst_stats = _generate(model, per_sync, params)
    assert [c.token_ids for c in burst] == [c.token_ids for c in steps]
    assert [c.finish_reason for c in burst] == [c.finish_reason for c in steps]
    for a, b in zip(burst, steps, strict=True):
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0)
    assert {c.finish_reason for c in steps} == {"stop", "length"}  # both limits crossed inside bursts
    assert step_stats["host_reads"] == step_stats["decode_steps"] + 1  # + the prefill's
    # a burst decodes (and reads) once per up to per_sync steps; it may run past a stop, never a limit
    assert burst_stats["host_reads"] <= 1 + burst_stats["decode_steps"] / per_sync + 8
    assert burst_stats["host_reads"] < step_stats["host_reads"] / 2
    assert all(len(c.token_ids) <= params.max_new_tokens for c in burst)


def test_a_burst_never_writes_past_the_cache(model):
    """Sequences near the model length: each burst is cut to the room every sequence has left."""
    params = SamplingParams(max_new_tokens=100, temperature=1.0, seed=1, ignore_eos=True)
    burst, stats = _generate(model, 8, params, max_len=24)
    steps, _ = _generate(model, 1, params, max_len=24)
    assert [c.token_ids for c in burst] == [c.token_ids for c in steps]
    assert all(c.finish_reason == "length" for c in burst)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=10, do_sample=False, logprobs=2),  # top log-probs per step
        SamplingParams(max_new_tokens=10, do_sample=False, logits_processor=lambda ids, row: row),
    ],
    ids=["top_log_probs", "logits_processor"],
)
def test_requests_that_need_every_step_decode_step_by_step(model, params):
    _, stats = _generate(model, 8, params)
    assert stats["host_reads"] == stats["decode_steps"] + 1


def test_a_waiting_request_is_admitted_at_the_next_step_not_after_a_burst(model):
    """With slots free, a queued request stops bursts: it joins as soon as step by step."""
    engine = _engine(model, 8)
    first = engine.add_request(_prompts(1)[0], SamplingParams(max_new_tokens=20, do_sample=False))
    engine.step()  # prefill + one decode
    second = engine.add_request(_prompts(1, seed=1)[0], SamplingParams(max_new_tokens=20, do_sample=False))
    engine.step()
    assert any(seq.request is second for seq in engine._running)  # joined, no burst in between
    while engine.has_unfinished():
        engine.step()
    assert first.done and second.done


def test_the_default_is_one_on_the_cpu_and_eight_on_a_gpu_and_zero_is_refused(model):
    assert decode_steps_per_sync({}, torch.device("cpu")) == 1
    assert decode_steps_per_sync({}, torch.device("cuda")) == 8
    assert decode_steps_per_sync({"decode_steps_per_sync": 4}, torch.device("cpu")) == 4
    with pytest.raises(ValueError, match="decode_steps_per_sync=0"):
        _engine(model, 0)


def test_the_engine_gives_decode_its_span_so_nothing_reads_the_lengths_back(model, monkeypatch):
    """``decode`` reads ``max(lengths)`` from the device only when not told it and gathering a span:
    the engine tells it (the paged kernel reads each row's own length and needs no span)."""
    spans = []
    original = EngineModel.decode

    def recording(self, tokens, lengths, cache, table, span=None, **kwargs):
        spans.append(span)
        assert kwargs["attention"] == "kernel" or span == int(lengths.max()) + 1
        return original(self, tokens, lengths, cache, table, span=span, **kwargs)

    monkeypatch.setattr(EngineModel, "decode", recording)
    for per_sync in (1, 4):
        _generate(model, per_sync, SamplingParams(max_new_tokens=12, do_sample=False, stop_token_ids=STOPS))
    assert spans


def test_the_config_refuses_a_count_below_one():
    from hybridflow.trainer.config import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError, match=r"decode_steps_per_sync must be null or an integer >= 1, got 0"):
        validate_config(load_config(["actor_rollout_ref.rollout.decode_steps_per_sync=0"]))
