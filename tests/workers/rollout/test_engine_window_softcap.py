"""Gemma 2, Gemma 3's text model and Mistral with a sliding window in the embedded engine (issue 48 item 5):
greedy tokens equal HF ``generate`` and log-probs HF eager's forward within 1e-5 in fp32, through both
decode attentions (the C paged kernel and the gathered span) and a prefill after a cached prefix. The
prompts are longer than the window (8 positions, blocks of 4: windows start mid-block). The controls
drop the window or the softcap and the tokens or log-probs move far past the tolerance, so the equality
is about them. Before, the engine refused these models."""

import dataclasses

import pytest
import torch
import transformers

from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.engine.attention import (
    LayerAttention,
    decode_attention,
    decode_masks,
    gather_span,
    grouped_scores_attention,
)
from hybridflow.workers.rollout.engine.model import engine_refusal
from hybridflow.workers.rollout.engine.paged_kernel import kernel_handles
from tests.tiny_configs import TINY_DECODER
from tests.workers.rollout.test_engine import EOS, _hf_greedy, _hf_log_probs

WINDOW, BLOCK, NEW = 8, 4, 12
FAMILIES = ("gemma2", "gemma3_text", "mistral")


def window_config(family: str, **overrides):
    """A tiny random config of ``family`` with a sliding window of :data:`WINDOW` (Gemma 2: every other
    layer; Gemma 3: ``layer_types``, with its local RoPE base; Mistral: every layer), Gemma's softcaps
    small enough to bite and ``query_pre_attn_scalar`` unlike the head dim."""
    # untied: a tied head reads back the scaled embedding, and Gemma would echo its last token
    fields = {
        **TINY_DECODER,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "tie_word_embeddings": False,
        **overrides,
    }
    if family == "gemma2":
        extra = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0, query_pre_attn_scalar=12)
        config = transformers.Gemma2Config(**{**extra, **fields})
    elif family == "gemma3_text":
        extra = dict(
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=5.0,
            query_pre_attn_scalar=12,
            rope_local_base_freq=100.0,
        )
        config = transformers.Gemma3TextConfig(**{**extra, **fields})
    else:
        config = transformers.MistralConfig(**fields)
    config._attn_implementation = "eager"
    return config


def window_model(family: str, **overrides):
    """HF eager on random weights: larger than the default init (peaked distributions), Gemma's norm
    weights away from 0 (their ``1 + w`` matters)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(window_config(family, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0, 0.2)
            elif "norm" in name:
                param.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return window_model(request.param)


def long_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of 9..23 tokens: longer than the window, so a dropped window changes the answer."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(WINDOW + 1, 3 * WINDOW, (count,), generator=gen).tolist()
    return [torch.randint(3, 97, (n,), generator=gen).tolist() for n in lengths]


def _engine(model, **kwargs) -> LLMEngine:
    return LLMEngine(
        EngineModel.from_hf_module(model, 96), 16, 96, eos_token_ids=[EOS], block_size=BLOCK, **kwargs
    )


def _check_against_hf(model, engine: LLMEngine, prompts: list[list[int]]) -> None:
    results = engine.generate_batch(prompts, SamplingParams(max_new_tokens=NEW, do_sample=False))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.completions[0].token_ids == _hf_greedy(model, prompt, NEW)
    rows = [(r.prompt_token_ids, r.completions[0].token_ids) for r in results]
    for result, want in zip(results, _hf_log_probs(model, rows), strict=True):
        assert (torch.tensor(result.completions[0].log_probs) - want).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", ["kernel", "gather"])
def test_greedy_equals_hf_generate_and_log_probs_its_forward(model, backend, monkeypatch):
    if backend == "kernel" and not kernel_handles(torch.float32):
        pytest.skip("no C compiler for the paged kernel")
    monkeypatch.setenv("HYBRIDFLOW_DECODE_ATTENTION", backend)
    _check_against_hf(model, _engine(model), long_prompts(5, seed=1))


def test_prefill_after_a_cached_prefix_keeps_the_window(model):
    """Prompts that extend cached ones: their prefill reads the prefix from the pool (the window then
    reaches back into cached blocks)."""
    engine = _engine(model)
    first = long_prompts(4, seed=2)
    engine.generate_batch(first, SamplingParams(max_new_tokens=1, do_sample=False))
    hits = engine.scheduler.pool.stats["prefix_hits"]
    longer = [p + [5, 6, 7, 8, 9, 10, 11] for p in first]
    _check_against_hf(model, engine, longer)
    assert engine.scheduler.pool.stats["prefix_hits"] > hits


def test_the_window_and_softcaps_matter():
    """The controls: the engine without the window (all families), or Gemma 2 without its softcaps,
    moves the log-probs far past 1e-5 (today's code refused these models; serving them as Llama would
    have given these answers)."""
    prompts = long_prompts(4, seed=3)
    for family in FAMILIES:
        model = window_model(family)
        engine = _engine(model)
        engine.model.attention_options = [
            LayerAttention(o.scale, o.softcap, None) for o in engine.model.attention_options
        ]
        assert _max_error(model, engine, prompts) > 1e-3, family
    model = window_model("gemma2")
    engine = _engine(model)
    engine.model.attention_options = [
        LayerAttention(o.scale, None, o.window) for o in engine.model.attention_options
    ]
    assert _max_error(model, engine, prompts) > 1e-3
    engine = _engine(model)
    engine.model.spec = dataclasses.replace(engine.model.spec, final_softcap=None)
    assert _max_error(model, engine, prompts) > 1e-3


def _max_error(model, engine: LLMEngine, prompts) -> float:
    results = engine.generate_batch(prompts, SamplingParams(max_new_tokens=NEW, do_sample=False))
    rows = [(r.prompt_token_ids, r.completions[0].token_ids) for r in results]
    return max(
        (torch.tensor(r.completions[0].log_probs) - want).abs().max().item()
        for r, want in zip(results, _hf_log_probs(model, rows), strict=True)
    )


@pytest.mark.parametrize("hd", [16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_window_and_softcap_equal_the_gathered_attention(dtype, hd):
    """The C kernel's window (each row from ``max(0, len - W + 1)``, mid-block starts included), scale and
    softcap against torch's gathered span with the same mask, in fp32 from the same (bf16) inputs: the
    kernel widens bf16 exactly and computes in fp32, then rounds its output to the pool's dtype. Head
    sizes that are a multiple of 64 sum the values in registers, others through memory."""
    if not kernel_handles(dtype):
        pytest.skip("no C compiler for the paged kernel")
    gen = torch.Generator().manual_seed(0)
    nkv, heads, blocks, bs = 2, 4, 40, BLOCK
    keys = torch.randn(nkv, blocks, bs, hd, generator=gen).to(dtype)
    values = torch.randn(nkv, blocks, bs, hd, generator=gen).to(dtype)
    lengths = torch.tensor([0, 3, 7, 8, 13, 30])
    table = torch.stack([torch.randperm(blocks, generator=gen)[:10] for _ in lengths])
    q = (3 * torch.randn(len(lengths), heads, 1, hd, generator=gen)).to(dtype)
    for options in (
        LayerAttention(0.3, 2.0, 5),
        LayerAttention(None, None, WINDOW),
        LayerAttention(0.2, 1.5),
    ):
        span = 32
        hidden = decode_masks(lengths, "gather", span, options.window)
        want = grouped_scores_attention(
            q.float(),
            gather_span(keys.float(), table, span),
            gather_span(values.float(), table, span),
            hidden,
            options.scale,
            options.softcap,
        )
        got = decode_attention(q, keys, values, table, lengths, "kernel", options=options)
        assert got.dtype == dtype
        rounding = 0 if dtype == torch.float32 else 2**-8  # bf16 keeps 8 bits of mantissa
        torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=rounding, atol=1e-5)


def test_refusals_name_the_support_table():
    assert engine_refusal({"model_type": "gemma"}).count("docs/model_support.md") == 1
    refusal = engine_refusal({"model_type": "qwen2", "use_sliding_window": True})
    assert "sliding-window" in refusal and "docs/model_support.md" in refusal
    assert engine_refusal({"model_type": "gemma3_text", "use_bidirectional_attention": True})
    for family in FAMILIES:
        assert engine_refusal(window_config(family).to_dict()) is None


def test_scoring_keeps_the_window_and_softcaps(model):
    """The teacher's scoring (one causal forward, no cache: :mod:`.scoring`) gives HF's log-probs too."""
    from hybridflow.workers.rollout.engine.scoring import score_sequences

    prompts = long_prompts(3, seed=5)
    engine_model = EngineModel.from_hf_module(model, 96)
    scored = score_sequences(engine_model, prompts, [1] * len(prompts), k=3)
    for ids, result in zip(prompts, scored, strict=True):
        (want,) = _hf_log_probs(model, [(ids[:1], ids[1:])])
        assert (result.token_log_probs - want).abs().max() <= 1e-5


def test_mixtral_with_a_sliding_window():
    """Mixtral's ``sliding_window`` covers every layer, as Mistral's (its experts: test_engine_moe.py)."""
    from tests.tiny_configs import tiny_decoder_config

    config = tiny_decoder_config("mixtral", "eager", sliding_window=WINDOW)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 1.0 if name.endswith("mlp.gate.weight") else 0.2)
    engine = _engine(model)
    assert [o.window for o in engine.model.attention_options] == [WINDOW, WINDOW]
    _check_against_hf(model, engine, long_prompts(4, seed=1))
