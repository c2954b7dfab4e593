"""The static decode step (engine/decode_step.py) on the CPU: batches padded to buckets give the
tokens and log-probs of the eager step, padding rows never change a real row, the cases that need the
eager step fall back and are counted, and one decode step or burst is a fixed set of ops with one
host read. (The CUDA capture of the same step: tests/cuda/test_cuda_graphs.py.)"""

import pytest
import torch

from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.engine.decode_step import decode_buckets
from hybridflow.workers.rollout.engine.op_count import profile_step
from tests.workers.rollout.test_engine import EOS, _prompts, _random_model

STOPS = (5, 11, 17)
BUCKETS = [1, 2, 4, 8, 16, 32]


@pytest.fixture(scope="module")
def model():
    return _random_model("qwen2")  # GQA (4 query heads over 2 kv heads), q/k/v biases


def _engine(model, pad: bool, per_sync: int = 1, slots: int = 32, max_len: int = 48) -> LLMEngine:
    return LLMEngine(
        EngineModel.from_hf_module(model, max_len),
        slots,
        max_len,
        eos_token_ids=[EOS],
        decode_steps_per_sync=per_sync,
        cudagraph_capture_sizes=BUCKETS,
        pad_batches=pad,
    )


def _identity(token_ids, logits):
    return logits


PARAMS = [
    SamplingParams(max_new_tokens=30, do_sample=False, stop_token_ids=STOPS),
    SamplingParams(max_new_tokens=30, temperature=0.8, top_k=20, top_p=0.9, stop_token_ids=STOPS, seed=7),
    SamplingParams(max_new_tokens=30, temperature=1.3, stop_token_ids=STOPS, seed=11, seed_sample=3),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded-top-k-top-p", "seeded-t1.3"])
@pytest.mark.parametrize("per_sync", [1, 4])
def test_the_padded_static_step_gives_the_eager_steps_tokens(model, params, per_sync):
    """Today's path (the eager step, forced by a logits processor that changes nothing) against the
    static step padded to buckets: rows of different lengths join and leave (7 slots for 24 samples),
    so the batch walks through several buckets with real rows beside padding rows."""
    from dataclasses import replace

    prompts = _prompts(12, seed=3)
    eager = _engine(model, pad=False, slots=7)
    reference = eager.generate_batch(prompts, replace(params, logits_processor=_identity), n=2)
    assert eager.stats["static_steps"] == 0 and eager.eager_reasons["logits_processor"] > 0

    static = _engine(model, pad=True, per_sync=per_sync, slots=7)
    results = static.generate_batch(prompts, params, n=2)
    assert static.stats["eager_steps"] == 0 and static.stats["padded_rows"] > 0
    pairs = [
        (a, b) for r, q in zip(reference, results, strict=True) for a, b in zip(r.completions, q.completions)
    ]
    # near-tie policy: tokens equal wherever the top-2 logit gap exceeds 1e-3; in fp32 on this tiny
    # model none comes that close, so every token must be equal
    assert [a.token_ids for a, _ in pairs] == [b.token_ids for _, b in pairs]
    assert [a.finish_reason for a, _ in pairs] == [b.finish_reason for _, b in pairs]
    got = torch.tensor([x for _, b in pairs for x in b.log_probs])
    want = torch.tensor([x for a, _ in pairs for x in a.log_probs])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_padding_rows_never_change_a_real_row(model):
    """Rows 0..2 of a bucket of 8: whatever the padding rows hold, the real rows' logits and every
    block but the scratch block 0 (where padding rows write) are bit for bit the same."""
    em = EngineModel.from_hf_module(model, 32)
    engine = LLMEngine(em, 8, 32, eos_token_ids=[EOS])
    cache = engine.cache
    gen = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        for tensor in layer:
            tensor.normal_(generator=gen)
    saved = [(k.clone(), v.clone()) for k, v in cache.layers]
    real_tokens, real_lengths = torch.tensor([4, 9, 30]), torch.tensor([3, 17, 8])
    real_tables = torch.tensor([[1, 2], [3, 4], [5, 6]])  # padding rows: the scratch block 0
    outs = []
    for pad_tokens, pad_lengths in (([0] * 5, [0] * 5), ([60, 2, 33, 7, 90], [20, 1, 5, 0, 12])):
        for (k, v), (k0, v0) in zip(cache.layers, saved, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        tokens = torch.cat((real_tokens, torch.tensor(pad_tokens)))
        lengths = torch.cat((real_lengths, torch.tensor(pad_lengths)))
        tables = torch.cat((real_tables, torch.zeros(5, 2, dtype=torch.long)))
        logits = em.decode(tokens, lengths, cache, tables, span=21, attention=engine.decoder.attention)
        outs.append((logits[:3].clone(), [k[:, 1:].clone() for k, _ in cache.layers]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1], strict=True))


def test_cases_that_need_the_eager_step_fall_back_and_are_counted(model):
    engine = _engine(model, pad=True)
    base = SamplingParams(max_new_tokens=4, do_sample=False)
    from dataclasses import replace

    cases = {
        "logits_processor": replace(base, logits_processor=_identity),
        "logprobs": replace(base, logprobs=2),
        "stop_checker": replace(base, stop_checker=lambda ids: False),
    }
    for reason, params in cases.items():
        engine.generate_batch(_prompts(2), params)
        assert engine.eager_reasons.get(reason, 0) > 0, reason
    engine.add_request([5, 6, 7], base)
    engine.add_request([5, 6, 8], replace(base, do_sample=True, temperature=0.7))
    while engine.has_unfinished():
        engine.step()
    assert engine.eager_reasons["mixed_params"] > 0
    steps = engine.stats["static_steps"]
    engine.generate_batch(_prompts(3), base)
    assert engine.stats["static_steps"] > steps  # one rollout's shared settings: the static step


@pytest.mark.parametrize("per_sync", [1, 4])
def test_a_decode_step_is_a_fixed_set_of_ops_with_one_host_read(model, per_sync):
    """The op counter (engine/op_count.py) over one engine step that only decodes: ``per_sync``
    decode steps, one read back, no op that waits for the device (no ``.item()``)."""
    engine = _engine(model, pad=True, per_sync=per_sync)
    params = SamplingParams(max_new_tokens=20, temperature=0.9, seed=3, ignore_eos=True)
    for prompt in _prompts(5):
        engine.add_request(prompt, params, n=2)
    engine.step()  # prefill and the first decode
    profile = profile_step(engine)
    assert profile["decode_steps"] == per_sync and profile["host_reads"] == 1
    assert profile["device_reads"] == 0
    assert profile["ops_per_decode_step"] > 0 and profile["top_ops"]
    again = profile_step(engine)
    assert again["aten_ops"] == profile["aten_ops"]  # the same ops every step: a static step


def test_buckets_follow_vllm_or_the_capture_sizes():
    assert decode_buckets(512)[:5] == [1, 2, 4, 8, 16] and decode_buckets(512)[-1] == 512
    assert len(decode_buckets(512)) == 51  # vLLM's list: [1, 2, 4] + range(8, 256, 8) + range(256, 513, 16)
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(256, [16, 4, 64]) == [4, 16, 64]
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        decode_buckets(8, [0, 4])


def test_the_bucket_is_the_smallest_that_holds_the_batch(model):
    engine = _engine(model, pad=True, slots=24)
    step = engine.decoder
    assert [step.bucket(b) for b in (1, 3, 5, 16, 17)] == [1, 4, 8, 16, 24]  # 32 > the cache's 24 slots
    assert _engine(model, pad=False).decoder.bucket(5) == 5  # the CPU default: no padding


def test_the_step_follows_in_place_weight_updates_and_re_makes_buffers_for_a_new_cache(model):
    """In-place weight loads keep every address (a captured graph reads the new weights); a released
    and re-allocated cache moves, and the step re-makes its buffers (and would re-capture)."""
    engine = _engine(model, pad=True)
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    before = engine.generate_batch(_prompts(3), params)
    signature = engine.decoder._signature
    with torch.no_grad():
        for name, param in model.named_parameters():
            engine.model.load_weight(name, param * 0.5)
    assert engine.decoder._addresses() == signature
    halved = engine.generate_batch(_prompts(3), params)
    fresh = LLMEngine(engine.model, 32, 48, eos_token_ids=[EOS]).generate_batch(_prompts(3), params)
    assert [c.token_ids for r in halved for c in r.completions] == [
        c.token_ids for r in fresh for c in r.completions
    ]
    assert [c.token_ids for r in halved for c in r.completions] != [
        c.token_ids for r in before for c in r.completions
    ]
    engine.release()
    engine.resume(8, 40)
    engine.generate_batch(_prompts(3), params)
    assert engine.decoder._signature != signature


def test_gathered_span_and_paged_kernel_give_the_same_tokens(model, monkeypatch):
    """The CUDA graph's attention (a gathered span of each row's blocks, padded to a bucket) against
    the CPU's paged kernel, through the engine: GQA, rows of different lengths, and a second turn
    continuing the first conversation (its prefix found in the cache)."""
    params = SamplingParams(max_new_tokens=12, do_sample=False)

    def two_turns(backend: str):
        monkeypatch.setenv("HYBRIDFLOW_DECODE_ATTENTION", backend)
        engine = _engine(model, pad=True, max_len=200)
        assert engine.decoder.attention == backend
        first = engine.generate_batch(_prompts(6, seed=5), params)
        follow = [
            r.prompt_token_ids + r.completions[0].token_ids + [7] * (20 * i) for i, r in enumerate(first)
        ]
        second = engine.generate_batch(follow, params)
        assert engine.pool.stats["prefix_hits"] > 0
        return [c.token_ids for r in first + second for c in r.completions]

    assert two_turns("gather") == two_turns("kernel")
