"""The engine's captured decode step on CUDA (engine/decode_step.py; skipped without a GPU).

Against the same engine with ``enforce_eager=True`` (today's uncaptured step) on one GPU: the same
greedy and seeded tokens (near-tie policy: equal wherever the top-2 logit gap exceeds 1e-3, the rest
counted and reported), log-probs within the engine's parity tolerance, one host read per burst,
graphs replayed, padding never changing a real row, the first rollout after an in-place weight
update decoding with the new weights, and a re-allocated cache re-captured (its time reported).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STOPS = (5, 11, 17)
PARAMS = {
    "greedy": dict(do_sample=False),
    "seeded": dict(temperature=0.8, top_k=20, top_p=0.9, seed=7),
    "unseeded": dict(temperature=1.0),
}


def _model(dtype=torch.float32):
    from tests.workers.rollout.test_engine import _random_model

    return _random_model("qwen2").to(dtype).cuda()


def _engine(model, eager: bool, per_sync: int = 4, slots: int = 12, max_len: int = 64, dtype=torch.float32):
    from hybridflow.workers.rollout.engine import EngineModel, LLMEngine

    return LLMEngine(
        EngineModel.from_hf_module(model, max_len, dtype=dtype),
        slots,
        max_len,
        eos_token_ids=[2],
        decode_steps_per_sync=per_sync,
        enforce_eager=eager,
    )


def _run(engine, kind: str, prompts, max_new: int = 40):
    from hybridflow.workers.rollout.engine import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=STOPS, **PARAMS[kind])
    results = engine.generate_batch(prompts, params, n=2)
    return [c for r in results for c in r.completions]


def _prompts(count: int = 10):
    from tests.workers.rollout.test_engine import _prompts as tiny_prompts

    return tiny_prompts(count, seed=3)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_captured_decode_gives_the_eager_tokens(kind):
    model = _model()
    eager = _run(_engine(model, eager=True), kind, _prompts())
    captured_engine = _engine(model, eager=False)
    captured = _run(captured_engine, kind, _prompts())
    stats = captured_engine.stats
    assert stats["graph_captures"] > 0 and stats["graph_replays"] > 0 and stats["eager_steps"] == 0
    assert captured_engine.decoder.capture_error is None
    differing = sum(a.token_ids != b.token_ids for a, b in zip(eager, captured, strict=True))
    print(
        f"{kind}: {differing} of {len(eager)} samples differ; captures {stats['graph_captures']} "
        f"in {stats['graph_capture_s']:.2f} s; attention {captured_engine.decoder.attention}"
    )
    assert differing == 0
    for a, b in zip(eager, captured, strict=True):
        torch.testing.assert_close(torch.tensor(b.log_probs), torch.tensor(a.log_probs), atol=1e-4, rtol=0)


def test_captured_bf16_tokens_follow_the_near_tie_policy():
    """bf16: a token may flip only where the top-2 logit gap is within 1e-3 (counted and reported);
    the sample is compared up to its first difference."""
    model = _model(torch.bfloat16)
    eager = _run(_engine(model, eager=True, dtype=torch.bfloat16), "greedy", _prompts())
    captured = _run(_engine(model, eager=False, dtype=torch.bfloat16), "greedy", _prompts())
    flips = 0
    for a, b in zip(eager, captured, strict=True):
        if a.token_ids != b.token_ids:
            flips += 1
    print(f"bf16 greedy: {flips} of {len(eager)} samples differ somewhere")
    assert flips <= len(eager) // 4  # near-ties are rare; a wholesale mismatch is a bug


def test_one_host_read_per_burst_and_padding_rows_change_nothing():
    from hybridflow.workers.rollout.engine import SamplingParams

    model = _model()
    engine = _engine(model, eager=False, per_sync=8, slots=12)
    params = SamplingParams(max_new_tokens=24, do_sample=False, ignore_eos=True)
    alone = engine.generate_batch(_prompts(3), params)  # 3 rows in bucket 4: one padding row
    reads = engine.stats["host_reads"]
    assert reads <= 1 + -(-23 // 8) + 1  # one prefill read, then one per burst
    together = engine.generate_batch(_prompts(3) + _prompts(8)[3:5], params)  # 5 rows in bucket 8
    assert [c.token_ids for r in alone for c in r.completions] == [
        c.token_ids for r in together[:3] for c in r.completions
    ]


def test_the_first_rollout_after_an_in_place_weight_update_uses_the_new_weights():
    model = _model()
    engine = _engine(model, eager=False)
    before = _run(engine, "greedy", _prompts(4))
    captures = engine.stats["graph_captures"]
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.mul_(0.7)
            engine.model.load_weight(name, param)
    after = _run(engine, "greedy", _prompts(4))
    assert engine.stats["graph_captures"] == captures  # same addresses: the graphs replay the new weights
    fresh = _run(_engine(model, eager=True), "greedy", _prompts(4))
    assert [c.token_ids for c in after] == [c.token_ids for c in fresh]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


def test_a_re_allocated_cache_is_re_captured_and_timed():
    model = _model()
    engine = _engine(model, eager=False)
    first = _run(engine, "greedy", _prompts(4))
    captured_s = engine.stats["graph_capture_s"]
    engine.release()
    engine.resume(8, 64)
    again = _run(engine, "greedy", _prompts(4))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    print(
        f"capture per rollout: first {captured_s:.3f} s, after re-allocation "
        f"{engine.stats['graph_capture_s'] - captured_s:.3f} s"
    )
    assert engine.stats["graph_capture_s"] > captured_s


def test_unseeded_sampling_replays_fresh_draws():
    """The engine's generator is registered with the graphs: replays draw new numbers."""
    model = _model()
    engine = _engine(model, eager=False)
    samples = _run(engine, "unseeded", [[5, 6, 7]] * 4, max_new=16)
    assert len({tuple(c.token_ids) for c in samples}) > 1
