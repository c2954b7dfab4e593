"""verl's router-replay keys before Ray starts (issue 48 item 3): R3 and R2 on an MoE model pass; replay on a
dense model, the file keys, R3 without the rollout recording, recording outside the engine (vLLM, HF),
R2 on the reference and Ulysses with R2 are each refused with one line saying why. R3 runs in the sync
rollout, in server mode (``rollout.mode=async``) and in ``fully_async_main``."""

import pytest

from hybridflow.trainer.config import ConfigError, load_config, validate_config

ARR = "actor_rollout_ref"
R3 = [f"{ARR}.actor.router_replay.mode=R3", f"{ARR}.rollout.enable_rollout_routing_replay=true"]


@pytest.fixture()
def moe_overrides(base_overrides, tmp_path):
    import torch
    import transformers

    from tests.tiny_configs import tiny_decoder_config

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_decoder_config("qwen3_moe")).save_pretrained(tmp_path)
    return [*base_overrides, f"{ARR}.model.path={tmp_path}"]


def _problems(overrides) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(overrides))
    return str(info.value)


def test_verl_keys_have_verl_defaults(base_overrides):
    config = load_config(base_overrides)
    for section in ("actor", "ref"):
        replay = config.actor_rollout_ref[section].router_replay
        assert (replay.mode, replay.record_file, replay.replay_file) == ("disabled", None, None)
    assert config.actor_rollout_ref.rollout.enable_rollout_routing_replay is False


@pytest.mark.parametrize(
    "extra",
    [
        R3,
        [*R3, f"{ARR}.ref.router_replay.mode=R3"],
        [*R3, f"{ARR}.rollout.multi_turn.enable=true"],
        [*R3, f"{ARR}.actor.ulysses_sequence_parallel_size=2"],
        [f"{ARR}.actor.router_replay.mode=R2"],
        [*R3, f"{ARR}.rollout.mode=async"],
        [*R3, f"{ARR}.rollout.mode=async", f"{ARR}.rollout.multi_turn.enable=true"],
    ],
    ids=["R3", "R3_ref", "R3_multi_turn", "R3_ulysses", "R2", "R3_server_mode", "R3_server_tool_agent"],
)
def test_replay_on_an_moe_model_passes(moe_overrides, extra):
    validate_config(load_config([*moe_overrides, *extra]))


@pytest.mark.parametrize(
    "extra",
    [R3, [f"{ARR}.actor.router_replay.mode=R2"], [f"{ARR}.rollout.enable_rollout_routing_replay=true"]],
    ids=["R3", "R2", "record_only"],
)
def test_replay_on_a_dense_model_is_refused(base_overrides, extra):
    assert "is dense (qwen2, no mixture-of-experts layer); turn replay off" in _problems(
        [*base_overrides, *extra]
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            [f"{ARR}.actor.router_replay.record_file=/tmp/r.pt"],
            "router_replay.record_file='/tmp/r.pt': routing travels in the batch (routed_experts)",
        ),
        ([f"{ARR}.ref.router_replay.replay_file=/tmp/r.pt"], "ref.router_replay.replay_file='/tmp/r.pt'"),
        ([f"{ARR}.actor.router_replay.mode=R4"], "router_replay.mode='R4': use one of"),
        (
            [f"{ARR}.actor.router_replay.mode=R3"],
            "set actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        ),
        ([f"{ARR}.ref.router_replay.mode=R2"], "ref.router_replay.mode=R2: R2 records in the actor's"),
        (
            [f"{ARR}.actor.router_replay.mode=R2", f"{ARR}.rollout.enable_rollout_routing_replay=true"],
            "R2 replays the old-log-prob pass's own routing",
        ),
        ([*R3, f"{ARR}.rollout.name=hf"], "rollout.name=hf does not record routing here"),
        (
            [f"{ARR}.actor.router_replay.mode=R2", f"{ARR}.actor.ulysses_sequence_parallel_size=2"],
            "recording under Ulysses sequence parallelism is not built",
        ),
    ],
    ids=[
        "record_file",
        "replay_file",
        "mode",
        "r3_without_recording",
        "ref_r2",
        "r2_recording",
        "hf",
        "ulysses",
    ],  # fmt: skip
)
def test_what_does_not_run_is_refused_with_the_reason(moe_overrides, extra, message):
    assert message in _problems([*moe_overrides, *extra])


def test_r3_on_an_moe_model_passes_fully_async_main(moe_overrides, vllm_model_dir, arithmetic_data):
    """``fully_async_main``'s own checks, then its PPO view's (rollout.mode=async), accept R3."""
    from hybridflow.trainer.fully_async.main import check_config
    from tests.tiny_run import tiny_run_values

    values = tiny_run_values(vllm_model_dir, arithmetic_data, **{"trainer.n_gpus_per_node": 1})
    values[f"{ARR}.model.path"] = moe_overrides[-1].split("=", 1)[1]
    overrides = [f"{k}={v}" for k, v in values.items()]
    view = check_config(load_config([*overrides, *R3], config_name="fully_async_ppo_trainer"))
    assert view.actor_rollout_ref.rollout.enable_rollout_routing_replay is True
