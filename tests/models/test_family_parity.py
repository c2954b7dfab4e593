"""One parity test per model family we claim in docs/model_support.md (issue 48 item 6): on a tiny random
config of each ``model_type``, in fp32,

- HF eager's log-probs (each row alone, no padding) = the actor's (the CPU training attention, the padded
  layout, :func:`response_log_probs`) = the embedded engine's, within 1e-5;
- the engine's greedy tokens = HF ``generate``.

The responses are the engine's own greedy answers to prompts longer than the sliding windows (Mistral's
on every layer, Gemma's on some: :mod:`tests.workers.rollout.test_engine_window_softcap`), so every
family's whole path is compared: softcaps, (1 + w) norms and scaled embeddings (Gemma), q/k norms
(Qwen3, Gemma 3), biases (Qwen2), routing and experts (the MoE families, HF's per-expert loop as the
reference)."""

import pytest
import torch
import transformers

from hybridflow import keys
from hybridflow.models.attention import register_cpu_attention
from hybridflow.protocol import DataProto
from hybridflow.workers import packed_rows, shared_prefix
from hybridflow.workers.actor.dp_actor import response_log_probs
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from tests.models.test_softcap_window import _eager_reference
from tests.tiny_configs import MOE_FAMILIES, tiny_decoder_config
from tests.workers.rollout.test_engine import EOS, _hf_greedy
from tests.workers.rollout.test_engine_window_softcap import window_config

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", *MOE_FAMILIES, "gemma2", "gemma3_text")
NEW, PROMPT_LEN, PAD = 8, 16, 0
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35],
    [40, 41, 42, 43],
]


def _config(family: str, attn_implementation: str):
    if family in ("mistral", "gemma2", "gemma3_text"):  # with a sliding window (8 positions)
        config = window_config(family)
        config._attn_implementation = attn_implementation
    else:
        overrides = {"attention_bias": True} if family == "llama" else {}
        config = tiny_decoder_config(family, attn_implementation, **overrides)
    if family in MOE_FAMILIES:
        config._experts_implementation = "eager"  # HF's per-expert loop: the reference
    return config


def _models(family: str):
    """HF eager and the actor's model (the CPU training attention) on the same random weights: larger
    than the default init (peaked distributions), routers that spread tokens over the experts, Gemma's
    norm weights away from 0."""
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(_config(family, "eager")).eval()
    with torch.no_grad():
        for name, param in eager.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0)
            elif param.dim() >= 2:
                param.normal_(0, 0.2)
            elif "norm" in name and family.startswith("gemma"):
                param.normal_(0, 0.3)
    actor = transformers.AutoModelForCausalLM.from_config(_config(family, register_cpu_attention())).eval()
    actor.load_state_dict(eager.state_dict())
    return eager, actor


def _batch(rows: list[tuple[list[int], list[int]]]) -> DataProto:
    """The actor's padded layout: each prompt left-padded to PROMPT_LEN, each response right-padded."""
    ids, mask = [], []
    for prompt, response in rows:
        left, right = PROMPT_LEN - len(prompt), NEW - len(response)
        ids.append([PAD] * left + prompt + response + [PAD] * right)
        mask.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
    input_ids, attention_mask = torch.tensor(ids), torch.tensor(mask)
    return DataProto.from_dict(
        {
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: attention_mask,
            keys.POSITION_IDS: (attention_mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: input_ids[:, PROMPT_LEN:],
            keys.RESPONSE_MASK: attention_mask[:, PROMPT_LEN:],
        }
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_eager_equals_the_actor_equals_the_engine(monkeypatch, family):
    monkeypatch.setattr(packed_rows, "MAX_TOKEN_FRACTION", -1.0)  # the padded layout
    monkeypatch.setattr(shared_prefix, "MIN_SAVING", 1e9)
    eager, actor = _models(family)
    engine = LLMEngine(EngineModel.from_hf_module(eager, 64), 8, 64, eos_token_ids=[EOS], block_size=4)
    results = engine.generate_batch(PROMPTS, SamplingParams(max_new_tokens=NEW, do_sample=False))
    rows = []
    for prompt, result in zip(PROMPTS, results, strict=True):
        tokens = result.completions[0].token_ids
        assert tokens == _hf_greedy(eager, prompt, NEW), f"{family}: engine greedy != HF generate"
        rows.append((prompt, tokens))
    data = _batch(rows)
    mask = data.batch[keys.RESPONSE_MASK].float()
    reference = _eager_reference(eager, data, temperature=1.0).float()
    with torch.no_grad():
        ours, _ = response_log_probs(actor, data, temperature=1.0)
    torch.testing.assert_close(ours * mask, reference, rtol=0, atol=1e-5, msg=f"{family}: actor != HF eager")
    served = torch.zeros_like(reference)
    for row, result in enumerate(results):
        log_probs = result.completions[0].log_probs
        served[row, : len(log_probs)] = torch.tensor(log_probs)
    torch.testing.assert_close(served, reference, rtol=0, atol=1e-5, msg=f"{family}: engine != HF eager")
