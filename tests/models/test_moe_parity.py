"""Mixture-of-experts families in the actor's forward (issue 48 items 1 and 6, the training side): Qwen2-MoE
(shared expert with its sigmoid gate, a dense ``mlp_only_layers`` layer), Qwen3-MoE and Mixtral give HF
eager's log-probs (eager attention, eager per-expert loop) in fp32 within 1e-5, in the padded and the packed
layout, and both layouts the same gradients, experts and routers included. The routers are scaled up so
that every expert serves some token; the control swaps two experts and moves the log-probs by far more
than the tolerance, so the equality is about routed experts, not a no-op MoE block.

The router's auxiliary loss is off in every trained model, as in verl's FSDP actor
(:mod:`hybridflow.models.moe`); a config asking for it used to crash the packed forward."""

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from hybridflow.models import attention
from hybridflow.models.attention import register_cpu_attention
from hybridflow.models.moe import dense_lora_targets, is_moe_config, mlp_width_per_token
from hybridflow.workers import packed_rows, shared_prefix
from hybridflow.workers.actor.dp_actor import response_log_probs
from tests.models.test_softcap_window import _eager_reference
from tests.tiny_configs import MOE_FAMILIES, tiny_decoder_config
from tests.workers.grouped_batches import grouped_batch

PROMPT_LEN, RESPONSE_LEN, VOCAB = 7, 6, 97
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21]]
RESPONSE_LENGTHS = [[5, 2], [6, 3], [6]]


def _models(family: str):
    """Ours (the CPU training attention, transformers' default experts kernel) and HF eager (eager attention,
    the per-expert loop) on the same random weights, routers scaled so that routing is decisive."""
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(
        tiny_decoder_config(family, attn_implementation=register_cpu_attention())
    )
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(40.0)
    eager_config = tiny_decoder_config(family, attn_implementation="eager")
    eager_config._experts_implementation = "eager"
    eager = transformers.AutoModelForCausalLM.from_config(eager_config)
    eager.load_state_dict(ours.state_dict())
    return ours.eval(), eager.eval()


def _data():
    return grouped_batch(PROMPTS, RESPONSE_LENGTHS, PROMPT_LEN, RESPONSE_LEN, (23, VOCAB))


def _set_layout(monkeypatch, name: str) -> None:
    monkeypatch.setattr(packed_rows, "MAX_TOKEN_FRACTION", 1e9 if name == "packed" else -1.0)
    monkeypatch.setattr(shared_prefix, "MIN_SAVING", 1e9)


def _log_probs_and_grads(model, data):
    model.zero_grad()
    log_probs, _ = response_log_probs(model, data, temperature=1.0)
    mask = data.batch["response_mask"].float()
    (log_probs * mask).sum().backward()
    return log_probs.detach() * mask, {n: p.grad.clone() for n, p in model.named_parameters()}


def _experts_used(model, data) -> list[set[int]]:
    """The experts each router picked for some token of ``data`` (one set per sparse layer)."""
    picked = []
    hooks = [
        module.register_forward_hook(lambda m, i, out: picked.append(set(out[2].flatten().tolist())))
        for module in model.modules()
        if type(module).__name__.endswith("TopKRouter")
    ]
    with torch.no_grad():
        response_log_probs(model, data, temperature=1.0)
    for hook in hooks:
        hook.remove()
    return picked


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_log_probs_equal_hf_eager_in_both_layouts_with_the_same_gradients(monkeypatch, family):
    ours, eager = _models(family)
    data = _data()
    reference = _eager_reference(eager, data, temperature=1.0).float()
    calls = []
    real = attention.packed_attention
    monkeypatch.setattr(attention, "packed_attention", lambda *a: calls.append(1) or real(*a))
    results = {}
    for name in ("padded", "packed"):
        _set_layout(monkeypatch, name)
        results[name] = _log_probs_and_grads(ours, data)
        torch.testing.assert_close(results[name][0], reference, rtol=0, atol=1e-5, msg=f"{family} {name}")
        assert bool(calls) == (name == "packed")
    for key, grad in results["padded"][1].items():
        torch.testing.assert_close(results["packed"][1][key], grad, rtol=1e-4, atol=1e-6, msg=key)
    expert_grads = [g for n, g in results["packed"][1].items() if ".experts." in n or "mlp.gate." in n]
    assert expert_grads and all(g.abs().sum() > 0 for g in expert_grads)
    _set_layout(monkeypatch, "packed")
    assert all(used == {0, 1, 2, 3} for used in _experts_used(ours, data)), "an expert is never routed to"


def test_swapping_two_experts_moves_the_log_probs():
    """The control: the tolerance above is far below what routing a token to another expert changes."""
    ours, _ = _models("qwen3_moe")
    data = _data()
    with torch.no_grad():
        before, _ = response_log_probs(ours, data, temperature=1.0)
        for name, param in ours.named_parameters():
            if ".experts." in name:
                param.copy_(param[[1, 0, 2, 3]])
        after, _ = response_log_probs(ours, data, temperature=1.0)
    assert (after - before).abs().max() > 1e-3


def test_qwen2_moe_layers_follow_mlp_only_layers_and_keep_the_shared_expert_gate():
    ours, _ = _models("qwen2_moe")
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds == ["Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP", "Qwen2MoeSparseMoeBlock"]
    assert ours.model.layers[0].mlp.shared_expert_gate.weight.shape == (1, 64)
    # active MLP width per token: (2 x 32 + 48) on the sparse layers, 96 on the dense one
    assert mlp_width_per_token(ours.config) == pytest.approx((2 * 112 + 96) / 3)
    assert is_moe_config(ours.config) and not is_moe_config(tiny_decoder_config("qwen2"))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_lora_targets_are_attention_and_dense_parts_only(family):
    ours, _ = _models(family)
    targets = dense_lora_targets(ours)
    leaves = {name.rsplit(".", 1)[-1] for name in targets}
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= leaves
    assert not any(".experts" in n or n.endswith(("mlp.gate", "_gate")) or n == "lm_head" for n in targets)
    if family == "qwen2_moe":  # the dense layer's MLP and the shared experts
        assert (
            "model.layers.1.mlp.down_proj" in targets
            and "model.layers.0.mlp.shared_expert.up_proj" in targets
        )


def test_router_aux_loss_is_off_in_the_trained_model(tmp_path, monkeypatch):
    """verl's FSDP actor never adds the router's auxiliary loss; a model whose config asks for it (HF's
    ``output_router_logits``) is loaded with it off. Before, the packed forward failed in HF's
    ``load_balancing_loss_func`` (the packed rows' 4-D mask against the per-token router logits)."""
    from hybridflow.workers.model_builder import load_hf_model

    torch.manual_seed(0)
    config = tiny_decoder_config("qwen3_moe", output_router_logits=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_hf_model(OmegaConf.create({"path": str(tmp_path)}), "causal_lm", torch.float32)
    assert model.config.output_router_logits is False
    _set_layout(monkeypatch, "packed")
    log_probs, _ = response_log_probs(model, _data(), temperature=1.0)
    assert torch.isfinite(log_probs).all()
    model.config.output_router_logits = True  # as it was loaded before
    with pytest.raises(RuntimeError, match="size of tensor"):
        response_log_probs(model, _data(), temperature=1.0)
