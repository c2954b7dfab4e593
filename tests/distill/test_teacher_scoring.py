"""The engine's scoring without generating: its top-k equals an HF forward's top-k on the same ids."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.workers.rollout.engine import EngineModel
from hybridflow.workers.rollout.engine.llm_engine import LLMEngine
from tests.tiny_configs import tiny_decoder_config


def _engine(arch: str):
    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(tiny_decoder_config(arch), dtype=torch.float32).eval()
    model = EngineModel.from_hf_module(module, 128, dtype=torch.float32)
    return module, LLMEngine(
        model, max_num_seqs=2, max_model_len=128, eos_token_ids=[0], allocate_cache=False
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_top_k_equals_hf_forward(arch):
    module, engine = _engine(arch)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 97, (n,), generator=generator).tolist() for n in (9, 23, 2)]
    starts = [4, 11, 1]  # the prompt lengths: scored from there to the end
    k = 7
    scored = asyncio.run(engine.score(sequences, starts, k))
    for ids, start, got in zip(sequences, starts, scored, strict=True):
        with torch.no_grad():
            logits = module(input_ids=torch.tensor([ids])).logits[0].double()
        log_probs = torch.log_softmax(logits, dim=-1)[start - 1 : len(ids) - 1]  # predicting ids[start:]
        want_values, want_ids = log_probs.topk(k, dim=-1)
        assert got.top_log_probs.shape == (len(ids) - start, k)
        assert torch.equal(got.top_ids, want_ids)
        torch.testing.assert_close(got.top_log_probs.double(), want_values, atol=2e-5, rtol=0)
        own = log_probs.gather(-1, torch.tensor(ids[start:]).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(got.token_log_probs.double(), own, atol=2e-5, rtol=0)
    engine.step_in_thread = True  # the server's way: in the engine's step thread, the same numbers
    threaded = asyncio.run(engine.score(sequences, starts, k))
    assert all(torch.equal(a.top_log_probs, b.top_log_probs) for a, b in zip(scored, threaded, strict=True))
    # the engine generated nothing and held no cache slot
    assert engine.stats["prefill_tokens"] == 0 and not engine.cache.allocated


def test_engine_scoring_refuses_bad_requests():
    _, engine = _engine("llama")
    bad = [
        (([[5, 200]], [1], 3), "outside the model's vocabulary"),
        (([[5, 6]], [0], 3), "start=0"),
        (([[5, 6]], [1], 98), "top-k=98"),
        (([list(range(90)) * 2], [1], 3), "longer than max_model_len"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            asyncio.run(engine.score(*args))
