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
CONFIG_CLASSES = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config"}


def tiny_decoder_config(arch: str = "qwen2", attn_implementation: str | None = None, **overrides):
    """A :data:`TINY_DECODER` config of ``arch`` ("qwen2", "llama", "qwen3"), with ``overrides``;
    ``attn_implementation`` set on it when given."""
    config = getattr(transformers, CONFIG_CLASSES[arch])(**{**TINY_DECODER, **overrides})
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config
