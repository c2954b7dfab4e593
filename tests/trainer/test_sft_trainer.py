"""The SFT warm start runs on the FSDP2 worker code through Ray and writes a loadable HF model."""

import torch

from hybridflow.trainer.config import load_config
from hybridflow.trainer.sft_trainer import run_sft
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


def test_sft_run_lowers_loss_and_saves_hf_model(ray_session, tiny_model_dir, tmp_path):
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
        ],
        config_name="sft_trainer",
    )
    history = run_sft(config)
    assert len(history) == 8
    assert history[-1]["train/loss"] < history[0]["train/loss"]
    model = AutoModelForCausalLM.from_pretrained(target)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(model.model.embed_tokens.weight, initial.model.embed_tokens.weight)
