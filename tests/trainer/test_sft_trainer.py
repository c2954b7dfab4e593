"""The SFT warm start runs on the FSDP2 worker code through Ray and writes a loadable HF model."""

import pytest
import torch

from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.sft_trainer import run_sft, sft_tokenizer, validate_sft_config
from hybridflow.utils.dataset.sft_dataset import SFTDataset, collate_sft


def test_sft_dataset_masks_only_the_response(tiny_model_dir, tmp_path):
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, write_sft_dataset

    path = write_sft_dataset(tmp_path, ArithmeticTaskConfig(num_train=32, num_test=4), num_examples=4)
    tokenizer = load_tokenizer(tiny_model_dir)
    dataset = SFTDataset(str(path), tokenizer, max_length=64)
    row = dataset[0]
    response = tokenizer.decode(row["input_ids"][row["loss_mask"].bool()])
    assert response == f"{dataset.frame.iloc[0]['response']}<|im_end|>"
    batch = collate_sft([dataset[i] for i in range(4)])
    assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(-1).max()) < 64


@pytest.mark.parametrize("workers", [2, 1])  # one fp32 worker: a plain module, no FSDP2
def test_sft_run_lowers_loss_and_saves_hf_model(ray_session, tiny_model_dir, tmp_path, workers):
    from transformers import AutoModelForCausalLM

    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, write_sft_dataset

    data = write_sft_dataset(tmp_path, ArithmeticTaskConfig(num_train=64, num_test=4), num_examples=64)
    target = tmp_path / "sft_model"
    config = load_config(
        [
            f"data.train_files={data}",
            f"model.path={tiny_model_dir}",
            f"trainer.default_local_dir={target}",
            "trainer.total_training_steps=8",
            "trainer.log_freq=1",
            "data.train_batch_size=16",
            "data.micro_batch_size_per_gpu=4",
            "optim.lr=3e-3",
            f"trainer.n_gpus_per_node={workers}",
        ],
        config_name="sft_trainer",
    )
    history = run_sft(config)
    assert len(history) == 8
    assert history[-1]["train/loss"] < history[0]["train/loss"]
    model = AutoModelForCausalLM.from_pretrained(target)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(model.model.embed_tokens.weight, initial.model.embed_tokens.weight)


# ------------------------------------------------------------------ honest config: sft_trainer.yaml
def _sft_config(tiny_model_dir, tmp_path, *overrides):
    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, write_sft_dataset

    data = write_sft_dataset(tmp_path, ArithmeticTaskConfig(num_train=8, num_test=2), num_examples=8)
    return load_config(
        [f"data.train_files={data}", f"model.path={tiny_model_dir}", "data.train_batch_size=4", *overrides],
        config_name="sft_trainer",
    )


SFT_REJECTED = [
    ("model.fsdp_config.model_dtype=bf16", "model_dtype=bf16 would keep the trained master weights"),
    ("optim.total_training_steps=5", "optim.total_training_steps=5 is not supported (the SFT trainer"),
    ("data.truncation=left", "data.truncation='left' is not supported"),
    ("model.fsdp_config.wrap_policy.min_num_params=1000", "wrap_policy.min_num_params=1000 is not supported"),
    ("trainer.logger=[console,swanlab]", "trainer.logger: 'swanlab' is not a tracker"),
    ("data.train_batch_size=3", "data.train_batch_size=3 does not split evenly over the 2 worker processes"),
    ("+model.lora_rank=8", "unknown config key 'model.lora_rank' (not in sft_trainer.yaml)"),
    ("trainer.device=tpu", "trainer.device must be cpu or cuda, not 'tpu'"),
]


@pytest.mark.parametrize(("override", "message"), SFT_REJECTED, ids=[o for o, _ in SFT_REJECTED])
def test_sft_rejects_undelivered_settings_before_ray(tiny_model_dir, tmp_path, override, message):
    """Each problem is one line of one ConfigError raised by run_sft before Ray or a worker starts."""
    config = _sft_config(tiny_model_dir, tmp_path, override, f"trainer.default_local_dir={tmp_path / 'out'}")
    with pytest.raises(ConfigError) as info:
        run_sft(config)
    assert message in str(info.value)
    assert not (tmp_path / "out").exists()


def test_sft_rejections_are_listed_together(tiny_model_dir, tmp_path):
    config = _sft_config(
        tiny_model_dir, tmp_path, "model.fsdp_config.model_dtype=bf16", "data.truncation=middle"
    )
    with pytest.raises(ConfigError) as info:
        validate_sft_config(config)
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid SFT config:" and len(lines) == 3


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.fsdp_config.mixed_precision=auto",),
        ("model.fsdp_config.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}",),
        ("data.truncation=right", "trainer.total_training_steps=3", "trainer.logger=[console,jsonl]"),
    ],
)
def test_sft_delivered_settings_pass(tiny_model_dir, tmp_path, overrides):
    validate_sft_config(_sft_config(tiny_model_dir, tmp_path, *overrides))


def test_sft_right_truncation_keeps_the_start_of_the_row(tiny_model_dir, tmp_path):
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, write_sft_dataset

    path = write_sft_dataset(tmp_path, ArithmeticTaskConfig(num_train=8, num_test=2), num_examples=2)
    tokenizer = load_tokenizer(tiny_model_dir)
    full = SFTDataset(str(path), tokenizer, max_length=256)[0]
    length = int(full["attention_mask"].sum())
    cut = SFTDataset(str(path), tokenizer, max_length=length - 3, truncation="right")[0]
    assert torch.equal(cut["input_ids"], full["input_ids"][: length - 3])
    with pytest.raises(ValueError, match="exceed data.max_length"):
        SFTDataset(str(path), tokenizer, max_length=length - 3, truncation="error")[0]


TOKENIZER_CODE = """from transformers import PreTrainedTokenizerFast


class SftCustomTokenizerFast(PreTrainedTokenizerFast):
    pass
"""


def test_sft_tokenizer_honours_trust_remote_code_and_external_lib(tiny_model_dir, tmp_path, monkeypatch):
    import json
    import shutil
    import sys

    from omegaconf import OmegaConf

    model = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenization_custom.py").write_text(TOKENIZER_CODE)
    config_file = model / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.SftCustomTokenizerFast"]}
    tokenizer_config["tokenizer_class"] = "SftCustomTokenizerFast"
    config_file.write_text(json.dumps(tokenizer_config))
    (tmp_path / "sft_external_lib_probe.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    # untrusted, transformers falls back to its generic tokenizer class (the directory's code is not run)
    untrusted = sft_tokenizer(OmegaConf.create({"path": str(model), "trust_remote_code": False}))
    assert type(untrusted).__name__ != "SftCustomTokenizerFast"
    assert "sft_external_lib_probe" not in sys.modules
    trusted = OmegaConf.create(
        {"path": str(model), "trust_remote_code": True, "external_lib": "sft_external_lib_probe"}
    )
    assert type(sft_tokenizer(trusted)).__name__ == "SftCustomTokenizerFast"
    assert sys.modules["sft_external_lib_probe"].LOADED
