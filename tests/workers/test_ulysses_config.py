"""verl's Ulysses keys are read, and the layouts that cannot run are errors before Ray starts."""

import json

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import ConfigError, load_config, validate_config
from hybridflow.trainer.config.parallelism import sequence_parallel_problems, sequence_parallel_sizes
from hybridflow.workers.ulysses import configured_sp_size, scale_token_budgets

ACTOR = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
ACTOR_ENGINE = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"


@pytest.fixture
def base(tiny_model_dir, arithmetic_data):
    train, test = arithmetic_data
    return [
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.use_kl_loss=true",  # a reference policy
    ]


def _problems(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(overrides))
    return str(info.value)


def test_either_key_sets_sp_and_the_reference_follows_the_actor(base):
    for key in (ACTOR, ACTOR_ENGINE):
        config = load_config([*base, f"{key}=2", "critic.enable=true"])
        validate_config(config)
        sizes, problems = sequence_parallel_sizes(config)
        assert problems == []
        assert sizes["actor_rollout_ref.actor"] == sizes["actor_rollout_ref.ref"] == 2
        assert sizes["critic"] == sizes["reward_model"] == 1
    config = load_config([*base, f"{ACTOR}=2", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1"])
    assert sequence_parallel_sizes(config)[0]["actor_rollout_ref.ref"] == 1


def test_conflicts_sizes_and_combinations_are_refused(base):
    message = _problems([*base, f"{ACTOR}=2", f"{ACTOR_ENGINE}=4"])
    assert f"{ACTOR}=2 and {ACTOR_ENGINE}=4 disagree" in message
    message = _problems([*base, "critic.enable=true", "critic.ulysses_sequence_parallel_size=3"])
    assert "critic.ulysses_sequence_parallel_size=3 does not divide the role's 2 worker processes" in message
    message = _problems([*base, f"{ACTOR}=2", "actor_rollout_ref.actor.tensor_model_parallel_size=2"])
    assert "both split the attention heads" in message
    message = _problems(
        [*base, f"{ACTOR}=2", "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]
    )
    assert "attn_implementation=sdpa" in message
    message = _problems(
        [
            *base,
            f"{ACTOR}=2",
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.target_modules=all-linear",
        ]
    )
    assert "ref.ulysses_sequence_parallel_size=1 must equal the actor's 2" in message


def test_the_head_rule_reads_the_models_config(base, tmp_path):
    """verl's rule: heads divisible by sp; kv heads divisible by sp or dividing it."""
    for heads, kv, ok in ((6, 2, False), (8, 3, False), (8, 2, True), (8, 8, True)):
        model = tmp_path / f"h{heads}_{kv}"
        model.mkdir()
        (model / "config.json").write_text(
            json.dumps({"model_type": "qwen2", "num_attention_heads": heads, "num_key_value_heads": kv})
        )
        config = load_config([*base, f"{ACTOR}=4", "trainer.n_gpus_per_node=4"])
        config.actor_rollout_ref.model.path = str(model)
        problems = [p for p in sequence_parallel_problems(config) if "heads" in p]
        assert (problems == []) == ok, (heads, kv, problems)
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    config = load_config([*base, f"{ACTOR}=2"])
    config.actor_rollout_ref.model.path = str(vlm)
    assert any("image inputs are not split" in p for p in sequence_parallel_problems(config))


def test_section_reading_and_token_budgets():
    section = OmegaConf.create({"ulysses_sequence_parallel_size": None, "ppo_max_token_len_per_gpu": 1000})
    assert configured_sp_size(section, OmegaConf.create({"ulysses_sequence_parallel_size": 2})) == 2
    assert configured_sp_size(section, None) == 1
    with pytest.raises(ValueError, match="must be a positive integer"):
        configured_sp_size(OmegaConf.create({"ulysses_sequence_parallel_size": 0}))
    scale_token_budgets(section, 2, ("ppo_max_token_len_per_gpu", "missing_budget"))
    assert section.ppo_max_token_len_per_gpu == 2000  # verl: x sp, each rank holds 1/sp of a sequence
