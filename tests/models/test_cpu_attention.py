"""The CPU attention the trained models load with (hybridflow/models/attention.py) against SDPA."""

import pytest
import torch
import transformers

from hybridflow.models import attention
from hybridflow.models.attention import register_cpu_attention
from tests.tiny_configs import tiny_decoder_config


def _models(dtype):
    out = []
    for impl in ("sdpa", register_cpu_attention()):
        torch.manual_seed(0)
        out.append(transformers.Qwen2ForCausalLM(tiny_decoder_config("qwen2", impl)).to(dtype))
    return out


def _inputs(kind: str):
    torch.manual_seed(1)
    batch, width = 4, 24
    ids = torch.randint(3, 97, (batch, width))
    if kind == "causal":
        return {"input_ids": ids}, torch.ones(batch, width, dtype=torch.bool)
    if kind == "left_padding":  # rows 0 and 1 start late; their padded queries attend nothing
        mask = torch.ones(batch, width, dtype=torch.long)
        mask[0, :5], mask[1, :9] = 0, 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}, mask.bool()
    # a 4-D boolean block mask, as shared-prompt packing passes it
    block = torch.ones(batch, 1, width, width, dtype=torch.bool).tril()
    block[:, :, 14:, 8:14] = False
    pos = torch.arange(width).expand(batch, width)
    return {"input_ids": ids, "attention_mask": block, "position_ids": pos}, torch.ones(
        batch, width, dtype=torch.bool
    )


@pytest.mark.parametrize("kind", ["causal", "left_padding", "block_mask"])
def test_outputs_and_gradients_equal_sdpa_in_float64(kind):
    sdpa, ours = _models(torch.float64)
    assert ours.config._attn_implementation == "hybridflow_cpu"
    inputs, valid = _inputs(kind)
    results = []
    for model in (sdpa, ours):
        logits = model(**inputs).logits
        loss = logits[valid].log_softmax(-1)[..., 5].sum()
        loss.backward()
        results.append((logits[valid], {n: p.grad for n, p in model.named_parameters()}))
    (ref, ref_grads), (got, got_grads) = results
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-8, atol=1e-10)


def test_bf16_tracks_float64_as_sdpa_does():
    sdpa, ours = _models(torch.bfloat16)
    exact, _ = _models(torch.float64)
    inputs, valid = _inputs("left_padding")
    truth = exact(**inputs).logits[valid]
    err_sdpa = (sdpa(**inputs).logits[valid].double() - truth).abs().mean()
    err_ours = (ours(**inputs).logits[valid].double() - truth).abs().mean()
    assert err_ours <= 1.5 * err_sdpa + 1e-3, (float(err_ours), float(err_sdpa))


def test_long_sequences_fall_back_to_sdpa(monkeypatch):
    calls = []
    from transformers.integrations import sdpa_attention

    real = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(
        sdpa_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    _, ours = _models(torch.float32)
    inputs, _ = _inputs("causal")
    ours(**inputs)
    assert not calls  # 4 x 4 heads x 24 x 24 weights: the matmul form
    monkeypatch.setattr(attention, "EAGER_MAX_BYTES", 1024)
    ours(**inputs)
    assert len(calls) == 2  # one per layer: above the bound, SDPA


def test_trained_models_load_with_it_on_the_cpu_unless_overridden(tiny_model_dir, monkeypatch):
    from omegaconf import OmegaConf

    from hybridflow.workers.model_builder import load_hf_model

    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cpu")
    model = load_hf_model(OmegaConf.create({"path": tiny_model_dir}), "causal_lm", torch.float32)
    assert model.config._attn_implementation == "hybridflow_cpu"
    cfg = OmegaConf.create({"path": tiny_model_dir, "override_config": {"attn_implementation": "sdpa"}})
    assert load_hf_model(cfg, "causal_lm", torch.float32).config._attn_implementation == "sdpa"
