"""Mixtures of experts in the engine (Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE,
Mixtral): greedy tokens equal HF ``generate``, log-probs equal HF's forward within 1e-5 in fp32, the
prefix cache and preemption change nothing, and a weight sync reaches the experts."""

import pytest
import torch

from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from tests.tiny_configs import MOE_FAMILIES, tiny_decoder_config
from tests.workers.rollout.test_engine import EOS, _hf_greedy, _hf_log_probs, _prompts


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_model(request):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_decoder_config(request.param, tie_word_embeddings=request.param != "mixtral")
    ).eval()
    with torch.no_grad():  # peaked distributions, and routers spread over every expert
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 1.0 if name.endswith("mlp.gate.weight") else 0.2)
    return model


def _engine(model, **kwargs) -> LLMEngine:
    return LLMEngine(EngineModel.from_hf_module(model, 96), 16, 96, eos_token_ids=[EOS], **kwargs)


def test_greedy_tokens_equal_hf_generate_and_log_probs_its_forward(moe_model):
    prompts = _prompts(6, seed=4)
    params = SamplingParams(max_new_tokens=10, do_sample=False)
    results = _engine(moe_model).generate_batch(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.completions[0].token_ids == _hf_greedy(moe_model, prompt, 10)
    rows = [(r.prompt_token_ids, r.completions[0].token_ids) for r in results]
    for result, want in zip(results, _hf_log_probs(moe_model, rows), strict=True):
        assert (torch.tensor(result.completions[0].log_probs) - want).abs().max() <= 1e-5


def test_every_expert_is_routed_to_and_grouped_experts_run_once_each(moe_model):
    """The routers spread tokens over all experts here (the parity above covers each of them), and an
    expert's tokens go through one matmul per layer, not one per token."""
    from hybridflow.workers.rollout.engine.moe import route

    engine_model = EngineModel.from_hf_module(moe_model, 96)
    sparse = next(layer.moe for layer in engine_model.layers if layer.moe is not None)
    hidden = torch.randn(64, engine_model.spec.hidden_size)
    _, experts = route(hidden, sparse)
    assert set(experts.flatten().tolist()) == set(range(sparse.spec.num_experts))


def test_prefix_cache_and_preemption_change_no_token(moe_model):
    params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    prompts = _prompts(6, seed=7)
    reference = _engine(moe_model, enable_prefix_caching=False).generate_batch(prompts, params, n=2)
    small = _engine(moe_model, num_blocks=6)
    tokens = [c.token_ids for r in small.generate_batch(prompts, params, n=2) for c in r.completions]
    assert small.stats["preemptions"] > 0
    assert tokens == [c.token_ids for r in reference for c in r.completions]


def test_a_weight_sync_reaches_the_experts(moe_model):
    engine_model = EngineModel.from_hf_module(moe_model, 96)
    name = next(n for n, _ in moe_model.named_parameters() if n.endswith("mlp.experts.down_proj"))
    before = engine_model.target(name).clone()
    engine_model.load_weight(name, before * 2)
    assert torch.equal(engine_model.target(name), before * 2)
    assert engine_model.weights_version > 1
