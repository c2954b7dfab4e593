"""Tiny randomly initialised causal LMs and byte-level BPE tokenizers, built offline.

Tests, examples and the CPU demo need a model without a hub: :func:`build_tiny_model` writes an
ordinary Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer files,
``generation_config.json``) that every loader in hybridflow (and plain ``from_pretrained``) reads.

The tokenizer splits every digit into its own token (Qwen2's pre-tokenizer regex, then
``Digits(individual_digits=True)``, then the byte-level mapping) so multi-digit arithmetic is
learnable column by column, and it carries a ChatML (Qwen-style) chat template. Using Qwen2's regex
matters: transformers 5 rebuilds a qwen2 directory's tokenizer with that regex on reload, so the
same pre-tokenizer everywhere keeps in-memory and reloaded ids identical.

Mixture-of-experts architectures (``qwen2_moe``, ``qwen3_moe``, ``mixtral``) take ``num_experts`` experts of
width ``intermediate_size``, ``num_experts_per_tok`` of them per token (docs/model_support.md).

CLI: ``python -m hybridflow.models.tiny --out DIR [--arch qwen2|llama|qwen3_moe|...] [--hidden-size N] ...``
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridflow.utils.registry import Registry

ENDOFTEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD]

# Qwen2's pre-tokenizer regex: contractions, letter runs, single digits, punctuation, whitespace.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# Qwen-style ChatML: "<|im_start|>{role}\n{content}<|im_end|>\n" per message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """Train a byte-level BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    Digits are isolated before BPE, so ``"123"`` is always the three tokens ``1 2 3``. Special
    tokens: ``<|endoftext|>`` (id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (2, eos), ``<|pad|>`` (3, pad).
    The vocabulary may come out smaller than ``vocab_size`` when ``texts`` are few.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    # Qwen2's split regex (it isolates every digit via ``\p{N}``), an explicit per-digit split that is
    # then a no-op but states the invariant, and the byte mapping. transformers 5 rebuilds exactly this
    # pipeline (Qwen2Tokenizer) when AutoTokenizer loads a qwen2 directory, so a reloaded tokenizer
    # gives the same ids as the in-memory one for every architecture.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, extra_special_tokens=[ENDOFTEXT, IM_START]
    )
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture sizes of a tiny model (the keyword arguments of :func:`build_tiny_model`)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 352
    max_position_embeddings: int = 256
    vocab_size: int = 512
    tie_word_embeddings: bool = True
    num_experts: int = 4  # mixture-of-experts architectures only
    num_experts_per_tok: int = 2


# arch name -> fn(spec, special token ids) -> transformers config
CONFIG_BUILDERS: Registry[Callable] = Registry("tiny model architecture")


def _common_config_kwargs(spec: TinyModelSpec, ids: dict[str, int]) -> dict:
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"hidden_size={spec.hidden_size} must divide by num_heads={spec.num_heads}, "
            f"which must divide by num_kv_heads={spec.num_kv_heads}"
        )
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )


@CONFIG_BUILDERS.register("qwen2")
def _qwen2_config(spec: TinyModelSpec, ids: dict[str, int]):
    from transformers import Qwen2Config

    return Qwen2Config(**_common_config_kwargs(spec, ids), use_sliding_window=False)


@CONFIG_BUILDERS.register("llama")
def _llama_config(spec: TinyModelSpec, ids: dict[str, int]):
    from transformers import LlamaConfig

    return LlamaConfig(**_common_config_kwargs(spec, ids))


@CONFIG_BUILDERS.register("qwen3_moe")
def _qwen3_moe_config(spec: TinyModelSpec, ids: dict[str, int]):
    """Every layer sparse: ``num_experts`` experts of width ``intermediate_size``, top-k renormalised."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_common_config_kwargs(spec, ids),
        moe_intermediate_size=spec.intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


@CONFIG_BUILDERS.register("qwen2_moe")
def _qwen2_moe_config(spec: TinyModelSpec, ids: dict[str, int]):
    """Sparse layers with a shared expert (its sigmoid gate) of width ``intermediate_size``; the last
    layer a dense MLP (``mlp_only_layers``) when there are two or more."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **_common_config_kwargs(spec, ids),
        moe_intermediate_size=spec.intermediate_size,
        shared_expert_intermediate_size=spec.intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        decoder_sparse_step=1,
        mlp_only_layers=[spec.num_layers - 1] if spec.num_layers > 1 else [],
        use_sliding_window=False,
    )


@CONFIG_BUILDERS.register("mixtral")
def _mixtral_config(spec: TinyModelSpec, ids: dict[str, int]):
    """Every layer sparse, top-k renormalised, no sliding window."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **_common_config_kwargs(spec, ids),
        num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        sliding_window=None,
    )


def build_tiny_model(
    out_dir: str | Path,
    texts: Iterable[str] | None = None,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 352,
    max_position_embeddings: int = 256,
    vocab_size: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
) -> Path:
    """Write a randomly initialised causal LM + tokenizer to ``out_dir`` and return the path.

    ``texts`` train the tokenizer (default: the built-in arithmetic task's texts). Weights come from
    ``torch.manual_seed(seed)``: the same arguments give byte-identical ``model.safetensors``. The
    embedding has ``max(vocab_size, len(tokenizer))`` rows. ``num_experts`` and ``num_experts_per_tok``:
    the mixture-of-experts architectures' experts (ignored by the dense ones).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if texts is None:
        from hybridflow.tasks.arithmetic import task_texts

        texts = task_texts()
    tokenizer = build_tokenizer(texts, vocab_size=vocab_size)
    spec = TinyModelSpec(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        vocab_size=max(vocab_size, len(tokenizer)),
        tie_word_embeddings=tie_word_embeddings,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
    )
    ids = {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    config = CONFIG_BUILDERS.get(arch)(spec, ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return save_tiny_model(model, tokenizer, out_dir)


def save_tiny_model(model, tokenizer, out_dir: str | Path) -> Path:
    """Save a freshly built tiny ``model`` and its ``tokenizer`` as an HF directory; generation stops at
    EOS or ``<|endoftext|>``, pads with the tokenizer's pad id."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(ENDOFTEXT)],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _int_fields() -> list[str]:
    """The integer sizes of :class:`TinyModelSpec`, each a ``--flag`` of the CLI."""
    return [k for k, v in asdict(TinyModelSpec()).items() if isinstance(v, int) and not isinstance(v, bool)]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = asdict(TinyModelSpec())
    parser = argparse.ArgumentParser(description="Build a tiny random causal LM + tokenizer offline.")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arch", default="qwen2", choices=CONFIG_BUILDERS.names())
    for name in _int_fields():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--untie-word-embeddings", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    sizes = {name: getattr(args, name) for name in _int_fields()}
    path = build_tiny_model(
        args.out, arch=args.arch, seed=args.seed, tie_word_embeddings=not args.untie_word_embeddings, **sizes
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
