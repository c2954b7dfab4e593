"""The embedded engine against Hugging Face: greedy tokens, log-probs, continuous batching, async."""

import asyncio

import pytest
import torch

from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from tests.tiny_configs import tiny_decoder_config

EOS = 2
GREEDY = SamplingParams(max_new_tokens=12, do_sample=False)


def _random_model(arch: str, **overrides):
    import transformers

    config = tiny_decoder_config(arch, **{"tie_word_embeddings": arch != "llama", **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights than the default init: peaked, diverse distributions
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3"])
def model(request):
    overrides = {"attention_bias": True} if request.param == "llama" else {}
    return _random_model(request.param, **overrides)


def _prompts(count: int, seed: int = 0, vocab: int = 97) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 14, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _engine(model, slots: int = 16, max_len: int = 64, seed: int = 0) -> LLMEngine:
    return LLMEngine(
        EngineModel.from_hf_module(model, max_len), slots, max_len, eos_token_ids=[EOS], seed=seed
    )


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _hf_log_probs(
    model, rows: list[tuple[list[int], list[int]]], temperature: float = 1.0
) -> list[torch.Tensor]:
    """The trainer's way: one left-padded batch forward with position ids from the mask."""
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        ids[i, width - len(p) - len(r) :] = torch.tensor(p + r)
        mask[i, width - len(p) - len(r) :] = 1
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    out = []
    for i, (_, r) in enumerate(rows):
        picked = log_probs[i, width - len(r) - 1 : width - 1].gather(1, torch.tensor(r).unsqueeze(1))
        out.append(picked.squeeze(1))
    return out


def test_greedy_matches_hf_generate_token_for_token(model):
    prompts = _prompts(10)
    results = _engine(model).generate_batch(prompts, GREEDY)
    for prompt, result in zip(prompts, results, strict=True):
        completion = result.completions[0]
        assert completion.token_ids == _hf_greedy(model, prompt, 12)
        assert completion.finish_reason == ("stop" if completion.token_ids[-1] == EOS else "length")


def test_sampled_log_probs_match_the_trainers_forward_in_any_batch(model):
    params = SamplingParams(max_new_tokens=10, temperature=0.8)
    prompts = _prompts(12, seed=1)
    big = _engine(model, slots=32, seed=3).generate_batch(prompts, params, n=2)
    rows = [(r.prompt_token_ids, c.token_ids) for r in big for c in r.completions]
    reported = [torch.tensor(c.log_probs) for r in big for c in r.completions]
    for got, want in zip(reported, _hf_log_probs(model, rows, temperature=0.8), strict=True):
        assert (got - want).abs().max().item() <= 1e-5


def test_batch_composition_does_not_change_greedy_tokens_or_log_probs(model):
    prompts = _prompts(12, seed=12)
    batched = _engine(model, slots=32).generate_batch(prompts, GREEDY, n=2)
    for prompt, result in zip(prompts[:4], batched, strict=False):
        alone = _engine(model, slots=1).generate_batch([prompt], GREEDY)[0].completions[0]
        for completion in result.completions:
            assert completion.token_ids == alone.token_ids
            assert max(abs(a - b) for a, b in zip(completion.log_probs, alone.log_probs, strict=True)) <= 1e-5


def test_a_prefill_of_prompts_of_different_lengths_computes_no_padding(model, monkeypatch):
    """Prompts of 2-13 tokens prefilled together: the linear layers see their real tokens packed (the
    sum of the lengths, not rows x the longest), and each prompt gets HF's greedy tokens."""
    prompts = _prompts(8, seed=5)
    assert len({len(p) for p in prompts}) > 1
    engine = _engine(model, slots=16)
    rows_seen = []
    real = engine.model._linear

    def linear(x, weight, bias=None):
        rows_seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(engine.model, "_linear", linear)
    requests = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()  # the prefill of all eight (then one decode step)
    assert rows_seen[0] == sum(len(p) for p in prompts) < len(prompts) * max(len(p) for p in prompts)
    while engine.has_unfinished():
        engine.step()
    for prompt, request in zip(prompts, requests, strict=True):
        assert request.completions[0].token_ids == _hf_greedy(model, prompt, GREEDY.max_new_tokens)


def test_request_joining_mid_flight_matches_running_alone(model):
    early, late = _prompts(6, seed=2), _prompts(1, seed=5)[0]
    engine = _engine(model, slots=8)
    requests = [engine.add_request(p, GREEDY) for p in early]
    for _ in range(4):
        engine.step()
    joined = engine.add_request(late, GREEDY)
    assert engine.num_running > 0  # it joins a batch that is already decoding
    while engine.has_unfinished():
        engine.step()
    alone = _engine(model, slots=1).generate_batch([late], GREEDY)[0]
    assert joined.completions[0].token_ids == alone.completions[0].token_ids
    assert [r.completions[0].token_ids for r in requests] == [
        r.completions[0].token_ids for r in _engine(model).generate_batch(early, GREEDY)
    ]


def test_more_requests_than_slots_all_finish_in_order(model):
    prompts = _prompts(9, seed=4)
    small = _engine(model, slots=3).generate_batch(prompts, GREEDY, n=1)
    large = _engine(model, slots=16).generate_batch(prompts, GREEDY, n=1)
    assert [r.completions[0].token_ids for r in small] == [r.completions[0].token_ids for r in large]


def test_n_samples_share_one_prefill(model):
    prompts = _prompts(3, seed=6)
    engine = _engine(model)
    results = engine.generate_batch(prompts, GREEDY, n=4)
    assert engine.stats["prefill_tokens"] == sum(len(p) for p in prompts)
    for result in results:
        assert len(result.completions) == 4
        assert all(c.token_ids == result.completions[0].token_ids for c in result.completions)


def test_async_requests_interleave_and_keep_their_order(model):
    prompts = _prompts(6, seed=7)
    engine = _engine(model, slots=4)

    async def main():
        return await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))

    results = asyncio.run(main())
    expected = _engine(model).generate_batch(prompts, GREEDY)
    assert [r.prompt_token_ids for r in results] == prompts
    assert [r.completions[0].token_ids for r in results] == [r.completions[0].token_ids for r in expected]
    assert not engine.has_unfinished()


def test_release_frees_the_cache_and_resume_restores_generation(model):
    prompts = _prompts(4, seed=8)
    engine = _engine(model)
    before = engine.generate_batch(prompts, GREEDY)
    engine.release()
    assert engine.cache.nbytes == 0
    with pytest.raises(RuntimeError, match="resume"):
        engine.generate_batch(prompts, GREEDY)
    engine.scheduler.waiting.clear()
    engine.resume()
    assert engine.cache.nbytes > 0
    after = engine.generate_batch(prompts, GREEDY)
    assert [r.completions[0].token_ids for r in before] == [r.completions[0].token_ids for r in after]


def test_a_cache_sized_to_the_call_generates_the_same_tokens_and_log_probs(model):
    """resume(rows, length): only what the call runs is allocated, and the output is unchanged."""
    prompts = _prompts(5, seed=11)
    params = SamplingParams(max_new_tokens=6, do_sample=False, ignore_eos=True)
    full = _engine(model).generate_batch(prompts, params, n=2)
    engine = _engine(model)
    engine.release()
    rows, length = 2 * len(prompts), max(map(len, prompts)) + params.max_new_tokens
    engine.resume(rows, length)
    blocks = rows * -(-length // engine.cache.block_size)  # and the scratch block
    assert engine.cache.num_blocks == engine.cache.layers[0][0].shape[1] == blocks + 1
    sized = engine.generate_batch(prompts, params, n=2)
    for a, b in zip(full, sized, strict=True):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        for ca, cb in zip(a.completions, b.completions, strict=True):
            torch.testing.assert_close(torch.tensor(ca.log_probs), torch.tensor(cb.log_probs))
    engine.release()
    engine.resume(10**6, 10**6)  # never above the budget: max_num_seqs x max_model_len
    assert engine.cache.num_blocks == 16 * 64 // engine.cache.block_size + 1


def test_stop_tokens_and_length_limits(model):
    prompt = _prompts(1, seed=9)[0]
    free = _engine(model).generate_batch(
        [prompt], SamplingParams(max_new_tokens=8, do_sample=False, ignore_eos=True)
    )
    tokens = free[0].completions[0].token_ids
    assert len(tokens) == 8 and free[0].completions[0].finish_reason == "length"
    stop = tokens[3]
    cut = (
        _engine(model)
        .generate_batch(
            [prompt],
            SamplingParams(max_new_tokens=8, do_sample=False, ignore_eos=True, stop_token_ids=(stop,)),
        )[0]
        .completions[0]
    )
    assert cut.token_ids == tokens[: tokens.index(stop) + 1] and cut.finish_reason == "stop"
    short = _engine(model, max_len=len(prompt) + 3).generate_batch(
        [prompt], SamplingParams(max_new_tokens=50, do_sample=False, ignore_eos=True)
    )
    assert len(short[0].completions[0].token_ids) == 3  # bounded by max_model_len


def test_top_k_one_is_greedy(model):
    prompts = _prompts(4, seed=10)
    greedy = _engine(model).generate_batch(prompts, GREEDY)
    top1 = _engine(model, seed=11).generate_batch(
        prompts, SamplingParams(max_new_tokens=12, temperature=1.3, top_k=1)
    )
    assert [r.completions[0].token_ids for r in top1] == [r.completions[0].token_ids for r in greedy]


def test_bad_requests_are_refused_clearly():
    model = _random_model("qwen2")
    engine = _engine(model, slots=2, max_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(3, 19)), GREEDY)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request([5, 6], GREEDY, n=3)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(NotImplementedError, match="gpt2"):
        EngineModel.from_hf_module(gpt2, 16)


def test_bf16_engine_tracks_the_fp32_model():
    model = _random_model("qwen2")
    engine = LLMEngine(
        EngineModel.from_hf_module(model, 64, dtype=torch.bfloat16), 8, 64, eos_token_ids=[EOS], seed=0
    )
    results = engine.generate_batch(_prompts(6, seed=13), SamplingParams(max_new_tokens=8))
    rows = [(r.prompt_token_ids, c.token_ids) for r in results for c in r.completions]
    reported = torch.cat([torch.tensor(c.log_probs) for r in results for c in r.completions])
    reference = torch.cat(_hf_log_probs(model, rows))
    diff = (reported - reference).abs()
    assert engine.model.embed.dtype == torch.bfloat16
    assert diff.mean().item() < 0.05 and diff.max().item() < 0.5, diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_equals_sdpa(dtype):
    """Both decode attentions over the paged pool (the CPU kernel reading blocks in place, the gathered
    span) equal SDPA over each row's valid keys laid out contiguously: GQA, rows of different
    lengths, blocks scattered over the pool in any order."""
    from hybridflow.workers.rollout.engine.attention import decode_attention
    from hybridflow.workers.rollout.engine.paged_kernel import kernel_handles

    gen = torch.Generator().manual_seed(3)
    block, width = 16, 19  # 19 blocks of 16: up to 304 positions per row
    q = torch.randn(6, 4, 1, 16, generator=gen).to(dtype)
    keys, values = (torch.randn(2, 6 * width + 1, block, 16, generator=gen).to(dtype) for _ in range(2))
    table = torch.randperm(6 * width, generator=gen).view(6, width) + 1
    lengths = torch.tensor([0, 3, 130, 299, 17, 128])
    contiguous = [pool[:, table].flatten(2, 3).transpose(0, 1) for pool in (keys, values)]  # (B, nkv, S, hd)
    visible = torch.arange(width * block)[None] <= lengths[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), *(t.double() for t in contiguous), attn_mask=visible[:, None, None, :], enable_gqa=True
    )
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    backends = ["gather"] + (["kernel"] if kernel_handles(dtype) else [])
    for backend in backends:
        got = decode_attention(q, keys, values, table, lengths, backend, span=300)
        torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=0, msg=backend)
    assert "kernel" in backends, "the paged kernel did not build here (a C compiler is part of the CI image)"


def test_fused_rms_norm_and_rope_give_the_hf_formulas_bits():
    """The engine's fp32 RMSNorm (torch's fused op) and RoPE (a roll against a sign-flipped sin table)
    are HF's formulas bit for bit: normalise, cast, scale; ``x * cos + rotate_half(x) * sin``."""
    from hybridflow.workers.rollout.engine.model import apply_rope, rms_norm, signed_sin

    gen = torch.Generator().manual_seed(5)
    for hidden in (8, 64, 576, 3584):
        x = torch.randn(3, 17, hidden, generator=gen) * 7
        weight = torch.randn(hidden, generator=gen)
        x32 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        assert torch.equal(rms_norm(x, weight, 1e-6), weight * x32)
    x = torch.randn(4, 5, 6, 64, generator=gen)
    cos, sin = torch.randn(4, 5, 1, 64, generator=gen), torch.randn(4, 5, 1, 64, generator=gen)
    rotated = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    assert torch.equal(apply_rope(x, cos, signed_sin(sin)), x * cos + rotated * sin)
