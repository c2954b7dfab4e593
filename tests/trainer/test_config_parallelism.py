"""Tensor-parallel layouts: sound ones pass validation, the rest are start-up errors that say why."""

import pytest

from hybridflow.trainer.config import ConfigError, load_config, validate_config

ACTOR, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


@pytest.mark.parametrize(
    "layout",
    [
        [f"{ACTOR}.tensor_model_parallel_size=2"],
        [f"{ROLLOUT}.tensor_model_parallel_size=2"],
        [f"{ACTOR}.tensor_model_parallel_size=2", f"{ROLLOUT}.tensor_model_parallel_size=2"],
        [f"{ACTOR}.tensor_model_parallel_size=2", "actor_rollout_ref.ref.tensor_model_parallel_size=1"],
        ["algorithm.adv_estimator=gae", "critic.tensor_model_parallel_size=2"],
    ],
    ids=["actor", "rollout", "both", "ref_differs", "critic"],
)
def test_layouts_that_divide_pass(base_overrides, layout):
    validate_config(load_config([*base_overrides, *layout]))


def test_the_reference_follows_the_actor_unless_set(base_overrides):
    config = load_config([*base_overrides, f"{ACTOR}.tensor_model_parallel_size=2"])
    assert config.actor_rollout_ref.ref.tensor_model_parallel_size == 2


REJECTED = [
    (
        ["trainer.n_gpus_per_node=4", f"{ACTOR}.tensor_model_parallel_size=4", "data.train_batch_size=8"],
        "actor.tensor_model_parallel_size=4 does not divide the model's num_key_value_heads=2",
    ),
    (
        [f"{ACTOR}.tensor_model_parallel_size=3"],
        "actor.tensor_model_parallel_size=3 does not divide the role's 2 worker processes",
    ),
    (
        [
            "trainer.n_gpus_per_node=6",
            "data.train_batch_size=6",
            f"{ACTOR}.ppo_mini_batch_size=6",
            f"{ACTOR}.tensor_model_parallel_size=2",
            f"{ROLLOUT}.tensor_model_parallel_size=3",
        ],
        "one must divide the other",
    ),
    ([f"{ROLLOUT}.tensor_model_parallel_size=2", f"{ROLLOUT}.name=hf"], "needs the embedded engine"),
    (
        [f"{ROLLOUT}.tensor_model_parallel_size=2", f"{ROLLOUT}.multi_turn.enable=true"],
        "step their engines in lockstep",
    ),
    (
        [f"{ACTOR}.tensor_model_parallel_size=2", "actor_rollout_ref.model.lora_rank=4"],
        "lora_rank > 0 with actor/ref tensor_model_parallel_size > 1 is not supported",
    ),
    ([f"{ACTOR}.tensor_model_parallel_size=0"], "must be a positive integer"),
]


@pytest.mark.parametrize(("layout", "message"), REJECTED, ids=[m[:30] for _, m in REJECTED])
def test_layouts_that_cannot_run_are_rejected(base_overrides, layout, message):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config([*base_overrides, *layout]))
    assert message in str(info.value)
