"""``import_gguf`` on GGUF files this test writes itself (``gguf.GGUFWriter``), so no download is needed.

A tiny HF model from :func:`build_tiny_model` is written as GGUF the way llama.cpp's converter lays it
out (tensor names, q/k rows permuted for llama's rope, tokenizer as metadata), then imported back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hybridflow.models.import_gguf import import_gguf, main  # noqa: E402
from hybridflow.models.tiny import CHATML_TEMPLATE, build_tiny_model  # noqa: E402

PROMPTS = ["What is 12+34?", "hello world", "<|im_start|>user\n7*8=<|im_end|>\n<|im_start|>assistant\n"]
GEN = dict(max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=3)

# HF module name inside a decoder layer -> llama.cpp tensor name.
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
CONTROL, NORMAL = 3, 1  # llama.cpp token types


def _rope_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's row order for llama q/k: per head, the two rotary halves are interleaved."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def write_gguf(hf_dir: Path, path: Path, arch: str) -> Path:
    """Write the HF checkpoint in ``hf_dir`` as an F32 GGUF of ``arch`` (``llama`` or ``qwen2``)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    writer.add_vocab_size(cfg["vocab_size"])  # the embedding has more rows than the tokenizer has tokens
    vocab = tok["model"]["vocab"]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in special else NORMAL for t in tokens])
    writer.add_token_merges([" ".join(pair) for pair in tok["model"]["merges"]])
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|pad|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    def put(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, tensor.float().numpy())

    put("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in LAYER_TENSORS.items():
            for kind in ("weight", "bias"):
                tensor = weights.get(f"model.layers.{i}.{hf_name}.{kind}")
                if tensor is None:
                    continue
                if arch == "llama" and gguf_name in ("attn_q", "attn_k"):
                    heads = cfg["num_attention_heads" if gguf_name == "attn_q" else "num_key_value_heads"]
                    tensor = _rope_permute(tensor, heads)
                put(f"blk.{i}.{gguf_name}.{kind}", tensor)
    put("output_norm.weight", weights["model.norm.weight"])
    put("output.weight", weights["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory) -> tuple[Path, Path]:
    """(original HF directory, GGUF file written from it)."""
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    hf_dir = build_tiny_model(
        root / "hf",
        arch=request.param,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=300,
        tie_word_embeddings=False,
    )
    return hf_dir, write_gguf(hf_dir, root / "gguf" / "tiny.gguf", request.param)


def _greedy(model, tokenizer) -> list[list[int]]:
    outs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        outs.append(model.generate(ids, **GEN)[0].tolist())
    return outs


def test_import_matches_gguf_and_original(tiny_gguf, tmp_path):
    hf_dir, gguf_file = tiny_gguf
    out = import_gguf(gguf_file, tmp_path / "out")

    config_text = (out / "config.json").read_text()
    assert "quantization_config" not in config_text and "gguf" not in config_text
    config = json.loads(config_text)
    assert "gguf" not in (out / "tokenizer_config.json").read_text()
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 300
    assert config["rms_norm_eps"] == 1e-6
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert getattr(model.config, "quantization_config", None) is None
    assert next(model.parameters()).dtype == torch.float32
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (0, 2, 3)

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == CHATML_TEMPLATE
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|pad|>")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "2+3"}], add_generation_prompt=True)
    chat_ids = chat["input_ids"] if hasattr(chat, "keys") else chat
    assert tokenizer.decode(chat_ids) == "<|im_start|>user\n2+3<|im_end|>\n<|im_start|>assistant\n"

    original = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    original_tok = AutoTokenizer.from_pretrained(hf_dir)
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).eval()
    gguf_tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    for prompt in PROMPTS:
        assert tokenizer(prompt).input_ids == original_tok(prompt).input_ids == gguf_tok(prompt).input_ids

    # Bit-identical weights (the q/k permutation undone), so identical greedy continuations.
    converted = model.state_dict()
    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(converted[name], tensor, rtol=0, atol=0, msg=name)
    expected = _greedy(original, original_tok)
    assert _greedy(from_gguf, gguf_tok) == expected
    assert _greedy(model, tokenizer) == expected
    assert all(len(seq) > len(original_tok(p).input_ids) for seq, p in zip(expected, PROMPTS))


def test_cli_bf16_and_overwrite(tiny_gguf, tmp_path, capsys):
    _, gguf_file = tiny_gguf
    out = tmp_path / "out"
    import_gguf(gguf_file, out)
    with pytest.raises(FileExistsError, match="--overwrite"):
        import_gguf(gguf_file, out)
    with pytest.raises(SystemExit):
        main(["--gguf", str(gguf_file), "--out", str(out)])
    assert "already holds a model" in capsys.readouterr().err
    main(["--gguf", str(gguf_file), "--out", str(out), "--dtype", "bf16", "--overwrite"])
    assert "wrote" in capsys.readouterr().out
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")

    unsupported = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(unsupported), arch="gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: llama, qwen2"):
        import_gguf(unsupported, tmp_path / "out")
    with pytest.raises(ValueError, match="dtype"):
        import_gguf(unsupported, tmp_path / "out", dtype="fp16")

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="already holds a model"):
        import_gguf(unsupported, occupied)
    assert not (tmp_path / "out").exists()
