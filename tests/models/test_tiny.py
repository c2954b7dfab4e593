"""Tiny offline models and tokenizers: build, reload, digit splitting, chat template, determinism."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hybridflow.models.loading import get_generation_eos_ids, load_model_config, load_tokenizer
from hybridflow.models.tiny import CHATML_TEMPLATE, build_tiny_model, build_tokenizer, main
from hybridflow.tasks.arithmetic import task_texts

SMALL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
TRICKY_TEXTS = [
    "What is 1234 + 56?  Compute it.",
    "  12\n\n\n 3 ",
    "it's (hello) I'LL 7.5% -42",
    "é café ñ 日本 ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def texts():
    return task_texts(n=300)


@pytest.fixture(scope="module")
def tokenizer(texts):
    return build_tokenizer(texts)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, texts):
    return build_tiny_model(tmp_path_factory.mktemp("qwen"), texts=texts, **SMALL)


def test_build_writes_a_normal_hf_directory(qwen_dir, tokenizer):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (qwen_dir / name).is_file(), name
    config = json.loads((qwen_dir / "config.json").read_text())
    assert (
        config["model_type"] == "qwen2" and config["hidden_size"] == 32 and config["num_hidden_layers"] == 2
    )
    assert config["vocab_size"] == 512 and config["tie_word_embeddings"] is True
    generation = json.loads((qwen_dir / "generation_config.json").read_text())
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert generation["eos_token_id"] == [im_end, endoftext]
    assert generation["pad_token_id"] == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|pad|>")


def test_reload_offline_with_from_pretrained(qwen_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(qwen_dir, local_files_only=True)
    reloaded = AutoTokenizer.from_pretrained(qwen_dir, local_files_only=True)
    ids = reloaded("What is 12 + 34?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    assert reloaded.eos_token == "<|im_end|>" and reloaded.pad_token == "<|pad|>"
    for text in TRICKY_TEXTS:  # the reloaded tokenizer must agree with the in-memory one
        assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"], text


def test_every_digit_is_its_own_token(tokenizer):
    for text in ("1234567890", "What is 907 + 31?", "x=-4096.25"):
        tokens = [tokenizer.decode([i]) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
        digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
        assert all(len(t.strip()) == 1 for t in digit_tokens), tokens
        assert "".join(tokens) == text


def test_special_tokens_and_chat_template_round_trip(tokenizer):
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]) == [
        0,
        1,
        2,
        3,
    ]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == CHATML_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
    assert text == expected + "<|im_start|>assistant\n"
    no_gen = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_gen == expected
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert (
        tokenizer.decode(ids, skip_special_tokens=True)
        == "system\nBe brief.\nuser\nWhat is 2 + 3?\nassistant\n"
    )


def test_same_arguments_give_byte_identical_weights(tmp_path, texts, qwen_dir):
    again = build_tiny_model(tmp_path / "again", texts=texts, **SMALL)
    assert (again / "model.safetensors").read_bytes() == (qwen_dir / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (qwen_dir / "tokenizer.json").read_bytes()
    other = build_tiny_model(tmp_path / "other", texts=texts, seed=1, **SMALL)
    assert (other / "model.safetensors").read_bytes() != (qwen_dir / "model.safetensors").read_bytes()


def test_llama_arch_untied(tmp_path, texts, tokenizer):
    path = build_tiny_model(tmp_path / "llama", texts=texts, arch="llama", tie_word_embeddings=False, **SMALL)
    assert AutoConfig.from_pretrained(path).model_type == "llama"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    reloaded = AutoTokenizer.from_pretrained(path)
    for text in TRICKY_TEXTS:
        assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"], text
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 5, 7]])).logits.shape == (1, 3, 512)


def test_unknown_arch_lists_known_ones(tmp_path, texts):
    with pytest.raises(KeyError, match="llama.*qwen2"):
        build_tiny_model(tmp_path, texts=texts, arch="gpt9", **SMALL)


def test_cli_builds_default_texts_model(tmp_path, capsys):
    main(
        [
            "--out",
            str(tmp_path / "cli"),
            "--hidden-size",
            "16",
            "--num-layers",
            "1",
            "--num-heads",
            "2",
            "--num-kv-heads",
            "1",
            "--intermediate-size",
            "32",
            "--arch",
            "llama",
        ]
    )
    assert "wrote" in capsys.readouterr().out
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("llama", 16, 1)


# ---------------------------------------------------------------------------------------------- loading
def test_load_tokenizer_and_eos_ids(qwen_dir, tokenizer):
    loaded = load_tokenizer(qwen_dir)
    assert loaded.pad_token_id == tokenizer.pad_token_id
    assert get_generation_eos_ids(qwen_dir) == [2, 0]
    assert get_generation_eos_ids(loaded) == [2, 0]
    assert get_generation_eos_ids(tokenizer) == [2]  # in memory: no generation_config.json to read


def test_load_tokenizer_custom_template(qwen_dir):
    loaded = load_tokenizer(qwen_dir, custom_chat_template="{{ messages[0]['content'] }}")
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_load_tokenizer_pad_falls_back_to_eos(tmp_path, texts, caplog):
    tok = build_tokenizer(texts)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == "<|im_end|>" and loaded.pad_token_id == 2
    assert "no pad token" in caplog.text


def test_non_local_paths_fail_with_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no model-hub access"):
        load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        load_model_config("/nonexistent/model")


def test_load_model_config_overrides(qwen_dir):
    config = load_model_config(qwen_dir, {"attention_dropout": 0.1, "rope_parameters": {"rope_theta": 500.0}})
    assert config.attention_dropout == 0.1 and config.rope_parameters["rope_theta"] == 500.0
    assert load_model_config(qwen_dir).attention_dropout == 0.0
    with pytest.raises(ValueError, match="no attribute 'not_a_field'"):
        load_model_config(qwen_dir, {"not_a_field": 1})
