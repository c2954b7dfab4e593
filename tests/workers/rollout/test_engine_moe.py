"""Mixtures of experts in the engine (Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE,
Mixtral): greedy tokens equal HF ``generate``, log-probs equal HF's forward within 1e-5 in fp32, the
prefix cache, preemption and multi-step decode bursts change nothing, an expert's tokens run through
it grouped (one product per expert, not per token), and a weight sync reaches the experts."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


# aten matrix products: F.linear, ``@``, torch.matmul and einsum all reach one of these
_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm"})
_MATMULS_PER_EXPERT = 3  # gate, up, down (2 when gate/up are fused, as moe.py has them)


class _ExpertMatmuls(TorchDispatchMode):
    """Counts the matrix products whose operands lie in one of ``weights``' tensors (by address, so
    views such as ``gate_up[e]`` or its transpose count): ``calls[name]`` per tensor, ``experts[name]``
    the expert (first-dimension row) each routed-expert product read."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.weights = {n: w for n, w in weights.items() if w is not None}
        self.calls: collections.Counter = collections.Counter()
        self.experts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _MATMULS:
            for arg in [*args, *(kwargs or {}).values()]:
                if not isinstance(arg, torch.Tensor):
                    continue
                for name, weight in self.weights.items():
                    offset = arg.data_ptr() - weight.data_ptr()
                    if 0 <= offset < weight.nbytes:
                        self.calls[name] += 1
                        self.experts[name][offset // weight[0].nbytes] += 1
        return func(*args, **(kwargs or {}))


def test_every_expert_is_routed_to_and_grouped_experts_run_once_each(moe_model):
    """The routers spread tokens over all experts here (the parity above covers each of them), and an
    expert's tokens go through one matmul per layer, not one per token: for N tokens with top-k routing
    (N * k pairs, many more than the experts) a layer call runs at most gate/up/down per active expert
    (plus the router and the shared expert), far fewer than one product per (token, expert) pair."""
    from hybridflow.workers.rollout.engine.moe import moe_mlp, route

    engine_model = EngineModel.from_hf_module(moe_model, 96)
    sparse = next(layer.moe for layer in engine_model.layers if layer.moe is not None)
    spec = sparse.spec
    tokens = 64
    hidden = torch.randn(tokens, engine_model.spec.hidden_size)
    _, experts = route(hidden, sparse)
    active = set(experts.flatten().tolist())
    assert active == set(range(spec.num_experts))
    pairs = tokens * spec.top_k
    assert spec.num_experts * _MATMULS_PER_EXPERT * 4 <= pairs  # N * k much larger than the experts

    shared = ("shared_gate_up", "shared_down", "shared_gate")
    names = ("router", "gate_up", "down", *shared)
    counter = _ExpertMatmuls({name: getattr(sparse, name) for name in names})
    with torch.no_grad(), counter:
        out = moe_mlp(hidden, sparse, engine_model.act)
    assert out.shape == hidden.shape and out.abs().sum() > 0

    routed = counter.calls["gate_up"] + counter.calls["down"]
    assert 0 < routed <= len(active) * _MATMULS_PER_EXPERT, counter.calls
    assert routed < pairs * 2  # a per-token loop: gate_up and down for each (token, expert) pair
    for name in ("gate_up", "down"):  # every active expert's weights, each in one product (gate, up: 2)
        assert set(counter.experts[name]) == active, (name, counter.experts[name])
        assert max(counter.experts[name].values()) <= 2, (name, counter.experts[name])
    assert counter.calls["router"] <= 1
    shared_calls = sum(counter.calls[name] for name in shared)
    if spec.shared_size:  # Qwen2-MoE: the shared expert's gate/up, down and its sigmoid gate, once
        assert 0 < shared_calls <= 4, counter.calls
    else:
        assert shared_calls == 0


def test_bursts_decode_the_step_by_step_greedy_tokens(moe_model):
    """Multi-step bursts (``decode_steps_per_sync``) through the static decode step give an MoE model
    the tokens and log-probs of one step per read back."""
    prompts = _prompts(6, seed=5)
    params = SamplingParams(max_new_tokens=16, do_sample=False)
    runs = {}
    for per_sync in (1, 4):
        engine = _engine(moe_model, decode_steps_per_sync=per_sync)
        results = engine.generate_batch(prompts, params)
        runs[per_sync] = ([c for r in results for c in r.completions], engine.stats)
    (steps, step_stats), (burst, burst_stats) = runs[1], runs[4]
    assert [c.token_ids for c in burst] == [c.token_ids for c in steps]
    assert [c.finish_reason for c in burst] == [c.finish_reason for c in steps]
    for a, b in zip(burst, steps, strict=True):
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0)
    # the bursts ran on the static step, several decode steps per read back
    assert burst_stats["eager_steps"] == 0
    assert burst_stats["static_steps"] == burst_stats["decode_steps"] > 0
    assert step_stats["host_reads"] == step_stats["decode_steps"] + 1  # + the prefill's
    assert burst_stats["host_reads"] < step_stats["host_reads"] / 2, (burst_stats, step_stats)


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
