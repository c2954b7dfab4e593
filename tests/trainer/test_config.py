"""The config is checked as a whole before Ray starts: each problem is named in one error."""

import pytest

from hybridflow.trainer.config import ConfigError, load_config, validate_config


@pytest.fixture()
def base_overrides(tiny_model_dir, arithmetic_data):
    train, test = arithmetic_data
    return [
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=2",
    ]


def test_valid_config_passes(base_overrides):
    validate_config(load_config(base_overrides))


def test_unknown_device_is_an_error(base_overrides):
    with pytest.raises(ConfigError, match="trainer.device must be cpu or cuda, not 'tpu'"):
        validate_config(load_config([*base_overrides, "trainer.device=tpu"]))


def test_unknown_override_key_is_an_error():
    with pytest.raises(ConfigError, match="trainer.no_such_key"):
        load_config(["trainer.no_such_key=1"])


def test_user_yaml_with_ppo_trainer_defaults_three_levels(tmp_path, base_overrides):
    (tmp_path / "my_run.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - _self_\n"
        "data:\n  max_response_length: 7\n  train_batch_size: 8\n"
        "trainer:\n  experiment_name: mine\n"
    )
    config = load_config(
        [*base_overrides, "data.train_batch_size=4"], config_name="my_run", config_dir=tmp_path
    )
    assert config.data.max_response_length == 7  # user YAML over the defaults
    assert config.data.train_batch_size == 4  # command line over the user YAML
    assert config.trainer.experiment_name == "mine"
    assert config.actor_rollout_ref.rollout.response_length == 7  # interpolation follows
    validate_config(config)


def test_unknown_key_in_user_yaml_is_reported(tmp_path, base_overrides):
    (tmp_path / "bad.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\ntrainer:\n  savefreq: 3\n")
    config = load_config(base_overrides, config_name="bad", config_dir=tmp_path)
    with pytest.raises(ConfigError, match="unknown config key 'trainer.savefreq'"):
        validate_config(config)


def test_batch_sizes_that_do_not_divide(base_overrides):
    config = load_config([*base_overrides, "data.train_batch_size=5", "actor_rollout_ref.rollout.n=1"])
    with pytest.raises(ConfigError) as info:
        validate_config(config)
    message = str(info.value)
    assert "data.train_batch_size x rollout.n=5 is not divisible by worker processes=2" in message
    assert "data.train_batch_size=5 is not divisible by actor.ppo_mini_batch_size=2" in message


def test_micro_batch_must_divide_the_mini_batch(base_overrides):
    config = load_config([*base_overrides, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
    with pytest.raises(
        ConfigError, match="mini-batch per worker=2 is not divisible by .*micro_batch_size_per_gpu=3"
    ):
        validate_config(config)


def test_missing_files_and_unregistered_names_are_all_listed(base_overrides, tmp_path):
    config = load_config(
        [
            *base_overrides,
            f"data.train_files={tmp_path}/missing.parquet",
            "algorithm.adv_estimator=not_an_estimator",
            "actor_rollout_ref.actor.policy_loss.loss_mode=nope",
        ]
    )
    with pytest.raises(ConfigError) as info:
        validate_config(config)
    message = str(info.value)
    assert "missing.parquet' does not exist" in message
    assert "algorithm.adv_estimator='not_an_estimator' is not registered; registered: gae," in message
    assert "loss_mode='nope' is not registered" in message and "vanilla" in message


def test_lora_settings_are_validated(base_overrides, tmp_path):
    validate_config(load_config([*base_overrides, "actor_rollout_ref.model.lora_rank=8"]))
    with pytest.raises(ConfigError, match="lora_adapter_path"):
        validate_config(
            load_config(
                [
                    *base_overrides,
                    "actor_rollout_ref.model.lora_rank=8",
                    f"actor_rollout_ref.model.lora_adapter_path={tmp_path}",
                ]
            )
        )
    with pytest.raises(ConfigError, match="lora_alpha"):
        validate_config(
            load_config(
                [
                    *base_overrides,
                    "actor_rollout_ref.model.lora_rank=8",
                    "actor_rollout_ref.model.lora_alpha=0",
                ]
            )
        )
