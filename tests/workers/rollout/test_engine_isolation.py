"""One request fails alone, a waiter that leaves frees its slots, and the engine can step off the event
loop: the engine behaviours the OpenAI server relies on (tests/serve checks them over HTTP)."""

import asyncio
import time

import pytest
import torch

from hybridflow.workers.rollout.engine import EngineModel, EngineRequestError, LLMEngine, SamplingParams
from tests.tiny_configs import tiny_decoder_config

EOS = 2
GREEDY = SamplingParams(max_new_tokens=10, do_sample=False, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_decoder_config("qwen2")).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.2)
    return model


def _engine(hf_model, slots: int = 16, max_len: int = 64) -> LLMEngine:
    return LLMEngine(EngineModel.from_hf_module(hf_model, max_len), slots, max_len, eos_token_ids=[EOS])


PROMPTS = [[5 + i, 9, 11 + i, 4] for i in range(8)]


def _alone(hf_model) -> list[list[int]]:
    engine = _engine(hf_model)
    return [r.completions[0].token_ids for r in engine.generate_batch(PROMPTS, GREEDY)]


def test_token_ids_outside_the_vocabulary_and_oversized_seeds_are_refused_when_added(hf_model):
    engine = _engine(hf_model)
    vocab = hf_model.config.vocab_size
    with pytest.raises(
        ValueError, match=rf"token id {vocab} is outside the model's vocabulary \[0, {vocab}\)"
    ):
        engine.add_request([3, vocab], GREEDY)
    with pytest.raises(ValueError, match="token id -1 is outside"):
        engine.add_request([-1, 3], GREEDY)  # would silently wrap to the last embedding row
    sampled = SamplingParams(max_new_tokens=4, seed=2**63)
    with pytest.raises(ValueError, match="does not fit in a signed 64-bit integer"):
        engine.add_request([3, 4], sampled)
    assert not engine.has_unfinished()


def test_a_poison_request_beside_eight_good_ones_fails_alone(hf_model):
    """A logits processor that raises (a request that passed every check and still fails inside the
    engine's step): it fails with an error, the 8 others finish with their own tokens."""
    expected = _alone(hf_model)

    def poison(token_ids, logits):
        if len(token_ids) == 3:
            raise RuntimeError("bad constraint")
        return logits

    async def run():
        engine = _engine(hf_model)
        bad = SamplingParams(max_new_tokens=10, do_sample=False, ignore_eos=True, logits_processor=poison)
        calls = [engine.generate(p, GREEDY) for p in PROMPTS[:4]]
        calls.append(engine.generate([7, 8, 9], bad))
        calls += [engine.generate(p, GREEDY) for p in PROMPTS[4:]]
        results = await asyncio.gather(*calls, return_exceptions=True)
        return engine, results

    engine, results = asyncio.run(run())
    failure = results.pop(4)
    assert isinstance(failure, EngineRequestError) and "bad constraint" in str(failure)
    assert [r.completions[0].token_ids for r in results] == expected
    assert engine.stats["failed_requests"] == 1 and engine.num_running == 0


def test_a_prefill_that_fails_for_one_request_is_retried_alone(hf_model, monkeypatch):
    """A prefill raising for the batch is retried request by request: only the request that fails by
    itself fails; the step's others start and finish as they would have."""
    expected = _alone(hf_model)
    engine = _engine(hf_model)
    real = engine.model.prefill

    def prefill(tokens, *args, **kwargs):
        if (tokens[:, 0] == 90).any():
            raise RuntimeError("kernel failure")
        return real(tokens, *args, **kwargs)

    monkeypatch.setattr(engine.model, "prefill", prefill)
    good = [engine.add_request(p, GREEDY) for p in PROMPTS]
    poison = engine.add_request([90, 3, 4], GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert [r.completions[0].token_ids for r in good] == expected
    assert poison.result().error == "RuntimeError: kernel failure"
    assert poison.completions[0].finish_reason == "error"
    with pytest.raises(EngineRequestError, match="kernel failure"):
        engine.generate_batch([[90, 5]], GREEDY)  # the synchronous callers raise


def test_a_stop_checker_ends_decoding_in_the_engine(hf_model):
    engine = _engine(hf_model)
    decoded = engine.stats["generated_tokens"]
    params = SamplingParams(
        max_new_tokens=20, do_sample=False, ignore_eos=True, stop_checker=lambda ids: len(ids) >= 3
    )
    (result,) = engine.generate_batch([PROMPTS[0]], params)
    assert len(result.completions[0].token_ids) == 3 and result.completions[0].finish_reason == "stop"
    assert engine.stats["generated_tokens"] - decoded == 3  # not decoded on to max_new_tokens


def test_a_cancelled_waiter_and_a_closed_stream_free_their_slots(hf_model):
    async def run():
        engine = _engine(hf_model, max_len=200)
        long = SamplingParams(max_new_tokens=180, do_sample=False, ignore_eos=True)
        task = asyncio.ensure_future(engine.generate(PROMPTS[0], long, n=3))
        while engine.stats["generated_tokens"] < 6:
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert engine.num_running == 0 and engine.stats["aborted_requests"] == 1
        stream = engine.stream(PROMPTS[1], long, n=2)
        assert isinstance(await anext(stream), tuple)
        await stream.aclose()  # a streaming client that left
        assert engine.num_running == 0 and engine.stats["aborted_requests"] == 2
        return engine.stats["generated_tokens"]

    assert asyncio.run(run()) < 60


def test_stepping_in_a_thread_keeps_the_event_loop_answering(hf_model):
    """A step that takes 1.5 s (a slow logits processor stands in for a long prefill) does not hold
    the event loop: a ticker keeps running every few ms, and the tokens are those of the plain loop."""
    expected = _alone(hf_model)

    def slow(token_ids, logits):
        if len(token_ids) == 1:
            time.sleep(1.5)
        return logits

    async def run(in_thread: bool):
        engine = _engine(hf_model)
        engine.step_in_thread = in_thread
        slow_params = SamplingParams(max_new_tokens=3, do_sample=False, logits_processor=slow)
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        results = await asyncio.gather(
            engine.generate([6, 7], slow_params), *(engine.generate(p, GREEDY) for p in PROMPTS)
        )
        stop.set()
        await tick
        return max(gaps), [r.completions[0].token_ids for r in results[1:]]

    gap, tokens = asyncio.run(run(True))
    assert gap < 0.5 and tokens == expected
    blocked_gap, _ = asyncio.run(run(False))
    assert blocked_gap > 1.0  # the same step on the event loop holds it (what the thread removes)
