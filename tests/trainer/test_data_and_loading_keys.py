"""Config keys read by the driver and the loaders: ``data.trust_remote_code`` /
``model.trust_remote_code`` (a model directory with its own code), ``data.custom_cls`` (a user Dataset
class) and ``data.image_key`` (multimodal columns are an error, never silently dropped)."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.trainer.config import load_config

TOKENIZER_CODE = """from transformers import PreTrainedTokenizerFast


class CustomTokenizerFast(PreTrainedTokenizerFast):
    pass
"""
CONFIG_CODE = """from transformers import Qwen2Config


class CustomQwen2Config(Qwen2Config):
    model_type = "custom_qwen2"
"""


@pytest.fixture(scope="module")
def remote_code_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a tokenizer class and a config class of its own (``auto_map``), as a hub
    model with custom code ships them: transformers loads them only with trust_remote_code."""
    path = tmp_path_factory.mktemp("remote_code") / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "tokenization_custom.py").write_text(TOKENIZER_CODE)
    (path / "configuration_custom.py").write_text(CONFIG_CODE)
    for name, update in (
        (
            "tokenizer_config.json",
            {
                "auto_map": {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizerFast"]},
                "tokenizer_class": "CustomTokenizerFast",
            },
        ),
        (
            "config.json",
            {
                "auto_map": {"AutoConfig": "configuration_custom.CustomQwen2Config"},
                "model_type": "custom_qwen2",
            },
        ),
    ):
        data = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**data, **update}))
    return str(path)


def _overrides(model_dir, arithmetic_data, *extra):
    train, test = arithmetic_data
    return [
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=4",
        "trainer.logger=[console]",
        *extra,
    ]


def test_data_trust_remote_code_reaches_the_driver_tokenizer(
    remote_code_dir, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    from hybridflow.trainer.main_ppo import build_trainer

    monkeypatch.chdir(tmp_path)
    tokenizer = f"data.tokenizer={remote_code_dir}"
    trainer = build_trainer(
        load_config(_overrides(tiny_model_dir, arithmetic_data, tokenizer, "data.trust_remote_code=true"))
    )
    assert type(trainer.tokenizer).__name__ == "CustomTokenizerFast"
    with pytest.raises(ValueError, match="custom code"):
        build_trainer(load_config(_overrides(tiny_model_dir, arithmetic_data, tokenizer)))


def test_model_trust_remote_code_reaches_config_and_eos_loading(remote_code_dir, arithmetic_data):
    from hybridflow.models.loading import get_generation_eos_ids
    from hybridflow.trainer.ppo.workers_setup import _flops_counter

    trusted = load_config(
        _overrides(remote_code_dir, arithmetic_data, "actor_rollout_ref.model.trust_remote_code=true")
    )
    assert type(_flops_counter(trusted, ["cpu"]).config).__name__ == "CustomQwen2Config"
    with pytest.raises(ValueError, match="custom code"):
        _flops_counter(load_config(_overrides(remote_code_dir, arithmetic_data)), ["cpu"])
    assert get_generation_eos_ids(remote_code_dir, trust_remote_code=True) == [2, 0]
    with pytest.raises(ValueError, match="custom code"):
        get_generation_eos_ids(remote_code_dir)


DATASET_CODE = """from hybridflow.utils.dataset import RLHFDataset


class FirstRowsDataset(RLHFDataset):
    def __len__(self):
        return 8
"""


def test_custom_dataset_class_is_used(tiny_model_dir, arithmetic_data, tmp_path):
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.trainer.main_ppo import build_dataloaders

    (tmp_path / "my_data.py").write_text(DATASET_CODE)
    config = load_config(
        _overrides(
            tiny_model_dir,
            arithmetic_data,
            f"data.custom_cls.path={tmp_path / 'my_data.py'}",
            "data.custom_cls.name=FirstRowsDataset",
        )
    )
    train, val = build_dataloaders(config, load_tokenizer(tiny_model_dir))
    assert type(train.dataset).__name__ == "FirstRowsDataset" and len(train) == 2  # 8 rows / batch 4
    config.data.custom_cls.name = "os"
    with pytest.raises(TypeError, match="not a torch Dataset class"):
        build_dataloaders(config, load_tokenizer(tiny_model_dir))


def test_a_data_file_with_images_is_an_error(tiny_model_dir, tmp_path):
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.utils.dataset import RLHFDataset

    row = {"data_source": "x", "prompt": [{"role": "user", "content": "hi"}], "images": [b"\x89PNG"]}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "mm.parquet")
    from hybridflow.utils.dataset.multimodal import MultiModalInputError

    # image rows need a vision-language model (docs/vlm.md); the tiny text model has no vision tower
    no_tower = r"'images' column \(data.image_key\) but the model has no vision tower"
    with pytest.raises(MultiModalInputError, match=no_tower):
        RLHFDataset(str(tmp_path / "mm.parquet"), load_tokenizer(tiny_model_dir), {"max_prompt_length": 8})
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "mm2.parquet")
    config = {"max_prompt_length": 8, "image_key": "pixels"}  # the column has another name: plain text data
    assert len(RLHFDataset(str(tmp_path / "mm2.parquet"), load_tokenizer(tiny_model_dir), config)) == 1
