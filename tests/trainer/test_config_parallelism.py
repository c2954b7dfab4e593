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


@pytest.fixture()
def moe_model_dir(tmp_path):
    """A tiny Qwen3-MoE directory (config and weights: what the start-up checks read)."""
    import torch
    import transformers

    from tests.tiny_configs import tiny_decoder_config

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_decoder_config("qwen3_moe")).save_pretrained(tmp_path)
    return str(tmp_path)


def test_mixture_of_experts_refuses_tensor_parallelism_and_takes_ulysses(base_overrides, moe_model_dir):
    """An MoE model has no tensor- or expert-parallel plan: one line naming the key and the model type,
    before Ray starts. Ulysses splits its attention only (routing is per token), so SP = 2 passes."""
    moe = [
        *base_overrides,
        f"actor_rollout_ref.model.path={moe_model_dir}",
        "actor_rollout_ref.rollout.name=hf",
    ]
    with pytest.raises(ConfigError) as info:
        validate_config(load_config([*moe, f"{ACTOR}.tensor_model_parallel_size=2"]))
    assert (
        "actor_rollout_ref.actor.tensor_model_parallel_size=2: tensor parallelism supports ('llama', "
        "'mistral', 'qwen2', 'qwen3'), not 'qwen3_moe' (a mixture-of-experts model; expert parallelism is "
        "not built either); set 1"
    ) in str(info.value)
    validate_config(load_config([*moe, f"{ACTOR}.ulysses_sequence_parallel_size=2"]))


def test_the_engine_refuses_a_model_it_does_not_serve_before_ray_starts(base_overrides, tmp_path):
    """rollout.name=engine on a family the engine does not serve (Gemma 1): one line naming the model
    type and the support table, from the config check (the workers would only find out after Ray
    started). rollout.name=hf takes it; Gemma 2 (served since issue 48 item 5) passes the engine's check."""
    import torch
    import transformers

    sizes = dict(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.GemmaConfig(**sizes)).save_pretrained(tmp_path)
    gemma = [*base_overrides, f"actor_rollout_ref.model.path={tmp_path}"]
    with pytest.raises(ConfigError) as info:
        validate_config(load_config([*gemma, "actor_rollout_ref.rollout.name=engine"]))
    assert "actor_rollout_ref.rollout.name=engine: the embedded engine serves" in str(info.value)
    assert "not model_type='gemma' (docs/model_support.md's support table" in str(info.value)
    try:
        validate_config(load_config([*gemma, "actor_rollout_ref.rollout.name=hf"]))
    except ConfigError as error:  # whatever else it says, not the engine's refusal
        assert "rollout.name=engine:" not in str(error)
    served = tmp_path / "gemma2"
    transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(**sizes)).save_pretrained(served)
    try:
        overrides = [*base_overrides, f"actor_rollout_ref.model.path={served}"]
        validate_config(load_config([*overrides, "actor_rollout_ref.rollout.name=engine"]))
    except ConfigError as error:
        assert "rollout.name=engine:" not in str(error)
