"""FLOPs per architecture (hybridflow.utils.flops_formulas) and verl's FlopsCounter(config) API.

Tiny configs, counted by hand: 6 FLOPs per weight per token (dense) and 6 per query-key pair per
head dim per head per layer (causal scores)."""

import math
import warnings

import pytest

from hybridflow.utils.flops_counter import FlopsCounter
from hybridflow.utils.flops_formulas import step_flops

# hidden 8, 2 heads of dim 4, 1 KV head, 2 layers, vocab 10: attention projections 8 * (4 + 2) * 4 = 192
# per layer, embedding + LM head 2 * 10 * 8 = 160; one sequence of 3 tokens: 9 query-key pairs, so
# causal scores cost 6 * 9 * 4 * 2 heads * 2 layers = 864 unless a window cuts the pairs.
BASE = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
DENSE = dict(BASE, intermediate_size=16)  # SwiGLU 3 * 8 * 16 = 384 per layer -> N = 2 * 576 + 160 = 1312


def test_dense_decoder():
    assert step_flops(dict(DENSE, model_type="qwen3"), [3]) == 6 * 1312 * 3 + 864  # 24480


def test_mixture_of_experts_counts_the_router_and_the_routed_experts():
    # router 8 * 4 experts = 32, two routed experts 3 * 8 * 4 * 2 = 192, attention 192 -> 416 per layer;
    # N = 2 * 416 + 160 = 992
    moe = dict(BASE, model_type="qwen3_moe", moe_intermediate_size=4, num_experts=4, num_experts_per_tok=2)
    assert step_flops(moe, [3]) == 6 * 992 * 3 + 864  # 18720
    # Qwen2-MoE's shared expert (intermediate 2) adds 3 * 8 * 2 = 48 per layer: N = 1088
    shared = dict(moe, model_type="qwen2_moe", shared_expert_intermediate_size=2)
    assert step_flops(shared, [3]) == 6 * 1088 * 3 + 864  # 20448


def test_sliding_window_layers_attend_to_fewer_keys():
    # layer 1 slides over 2 keys: 3 * min(3, 2) = 6 pairs; layer 2 is full: 9 -> 6 * 15 * 4 * 2 = 720
    gemma = dict(
        DENSE, model_type="gemma3_text", layer_types=["sliding_attention", "full_attention"], sliding_window=2
    )
    assert step_flops(gemma, [3]) == 6 * 1312 * 3 + 720
    # without layer_types every 2nd layer is full under sliding_window_pattern=2: the same layout
    assert step_flops(dict(gemma, layer_types=None, sliding_window_pattern=2), [3]) == 6 * 1312 * 3 + 720


def test_apertus_mlp_has_no_gate():
    # xIELU MLP 2 * 8 * 16 = 256, attention 192, q/k norms 8 + 1 * 4 = 12 -> 460; N = 920 + 160 = 1080
    assert step_flops(dict(DENSE, model_type="apertus"), [3]) == 6 * 1080 * 3 + 864  # 20304


def test_deepseek_v3_latent_attention():
    # q: (8 + 2 heads * (nope 2 + rope 1)) * q_rank 4 = 56; kv: 8 * (2 + 1) + 2 * (2 + 2) * 2 = 40;
    # o: 2 * 2 * 8 = 32
    # -> attention 128. MoE layer: router 8 * 4 + 3 * 8 * 4 * (1 routed + 1 shared) = 224; dense layer 384.
    # N = (224 + 128) + (384 + 128) + 160 = 1024; scores 3 * 9 * 2 layers * (3 + 2) * 2 heads = 540
    config = dict(
        BASE,
        model_type="deepseek_v3",
        q_lora_rank=4,
        kv_lora_rank=2,
        qk_rope_head_dim=1,
        qk_nope_head_dim=2,
        v_head_dim=2,
        first_k_dense_replace=1,
        intermediate_size=16,
        moe_intermediate_size=4,
        n_routed_experts=4,
        num_experts_per_tok=1,
        n_shared_experts=1,
    )
    assert step_flops(config, [3]) == 6 * 1024 * 3 + 540  # 18972


def test_qwen3_vl_adds_the_vision_encoder():
    # ViT: patch 4 * 1 * 1 * 1 = 4; block 2 * 4 * 8 + 4 * 4 * 4 = 128; merger (4 + 4) * 4 = 32 -> 164
    # weights; 2 image tokens: 6 * 164 * 2 = 1968, bidirectional scores 12 * 4 pairs * 2 * 2 heads = 192
    vision = dict(
        hidden_size=4, depth=1, num_heads=2, intermediate_size=8, in_channels=1, temporal_patch_size=1,
        patch_size=1, spatial_merge_size=1, out_hidden_size=4, deepstack_visual_indexes=[],
    )  # fmt: skip
    config = dict(model_type="qwen3_vl", text_config=DENSE, vision_config=vision)
    assert step_flops(config, [3]) == 24480
    assert step_flops(config, [3], images_seqlens=[2]) == 24480 + 1968 + 192


def test_counter_speaks_verls_units_and_refuses_to_guess_a_moe():
    counter = FlopsCounter(dict(DENSE, model_type="llama"), peak_flops_per_s=1e12)
    achieved, promised = counter.estimate_flops([3], 0.5)  # TFLOP/s: 24480 FLOPs in 0.5 s
    assert achieved == pytest.approx(48960 / 1e12) and promised == 1.0
    assert FlopsCounter(DENSE, 1.0).formula == "llama"  # a dict without model_type: a Llama decoder
    with pytest.warns(UserWarning, match="counting it as a Llama-style dense decoder"):
        assert FlopsCounter(dict(DENSE, model_type="my_dense"), 1.0).estimate([3], 1.0)[0] == 24480
    with pytest.warns(UserWarning, match="MFU is not reported"):
        odd = FlopsCounter(dict(BASE, model_type="my_moe", num_local_experts=8), 1.0)
    assert math.isnan(odd.estimate([3], 1.0)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert FlopsCounter(dict(DENSE, model_type="mistral")).peak_flops_per_s > 0  # this device's peak
