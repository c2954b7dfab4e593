"""One tiny decoder config for tests that build random models of the supported families."""

import transformers

# 4 query heads over 2 kv heads (GQA), two layers: small enough for float64 reference runs
TINY_DECODER = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=97,
    max_position_embeddings=128,
)
CONFIG_CLASSES = {
    "qwen2": "Qwen2Config",
    "llama": "LlamaConfig",
    "qwen3": "Qwen3Config",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
}
# Mixture-of-experts fields on top of TINY_DECODER: 4 experts, 2 per token. Qwen2-MoE has three layers,
# the middle one dense (``mlp_only_layers``), the others sparse with the shared expert and its gate.
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
TINY_MOE = {
    "qwen2_moe": dict(
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
}


def tiny_decoder_config(arch: str = "qwen2", attn_implementation: str | None = None, **overrides):
    """A :data:`TINY_DECODER` config of ``arch`` (a key of :data:`CONFIG_CLASSES`; an MoE family adds its
    :data:`TINY_MOE` fields), with ``overrides``; ``attn_implementation`` set on it when given."""
    fields = {**TINY_DECODER, **TINY_MOE.get(arch, {}), **overrides}
    config = getattr(transformers, CONFIG_CLASSES[arch])(**fields)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config
