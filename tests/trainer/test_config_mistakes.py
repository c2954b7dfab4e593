"""Config mistakes are answered in one line each, with the fix (issue 46 item 2): a misspelled key names the
nearest valid key before Hydra's "not in struct"; a size that is not positive is named with its value (not
as "not divisible"), before Ray starts; a ConfigError prints as ``hybridflow: error: ...`` without Hydra's
banner and traceback (exit code 2); ``hybridflow.serve --model`` of a missing directory says so."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.trainer.config import ConfigError, load_config, validate_config

REPO = Path(__file__).parents[2]
TYPO = "unknown config key 'actor_rollout_ref.rollout.temprature' (not in ppo_trainer.yaml)"
TYPO_FIX = f"{TYPO}; did you mean 'actor_rollout_ref.rollout.temperature'?"


def run_module(module: str, *args: str, cwd: Path, full_error: bool = False) -> subprocess.CompletedProcess:
    """``python -m module args`` as a user runs it (its own process; in ``cwd``, where Hydra would write)."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HYDRA_FULL_ERROR", None)
    if full_error:
        env["HYDRA_FULL_ERROR"] = "1"
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def problems_of(overrides: list[str]) -> list[str]:
    return problems_of_config(load_config(overrides))


def problems_of_config(config) -> list[str]:
    """The lines of the ConfigError that ``validate_config`` raises."""
    with pytest.raises(ConfigError) as info:
        validate_config(config)
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid config:"
    return [line.removeprefix("  - ") for line in lines[1:]]


def the_one_problem(overrides: list[str]) -> str:
    """The single line of the ConfigError for ``overrides`` (failing when there are more or none)."""
    problems = problems_of(overrides)
    assert len(problems) == 1, problems
    return problems[0]


# ------------------------------------------------------------------------- a misspelled key: did you mean
@pytest.mark.parametrize(
    "override", ["actor_rollout_ref.rollout.temprature=0.7", "+actor_rollout_ref.rollout.temprature=0.7"]
)
def test_a_misspelled_key_on_the_command_line_names_the_nearest_key(override, tmp_path):
    """Was Hydra's "Could not override ... not in struct" suggesting ``+key=``, which only led to a second
    error. Answered before Hydra composes: nothing is written, no traceback."""
    run = run_module("hybridflow.trainer.main_ppo", override, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr == f"hybridflow: error: invalid command line: {TYPO_FIX}\n"
    assert not list(tmp_path.iterdir())  # Hydra never ran: no outputs/ folder


def test_several_misspelled_keys_are_listed_in_one_error(tmp_path):
    run = run_module(
        "hybridflow.trainer.main_ppo",
        "data.trian_batch_size=4",
        "actor_rollout_ref.rollout.n=2",  # a valid key among them
        "+trainer.savefreq=3",
        "no_such_section.key=1",
        cwd=tmp_path,
    )
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "hybridflow: error: invalid command line:",
        "  - unknown config key 'data.trian_batch_size' (not in ppo_trainer.yaml); "
        "did you mean 'data.train_batch_size'?",
        "  - unknown config key 'trainer.savefreq' (not in ppo_trainer.yaml); "
        "did you mean 'trainer.save_freq'?",
        "  - unknown config key 'no_such_section.key' (not in ppo_trainer.yaml)",
    ]


@pytest.mark.parametrize(
    ("module", "override", "message"),
    [
        (
            "fully_async_main",
            "async_training.staleness_threshhold=0.5",
            "unknown config key 'async_training.staleness_threshhold' (not in fully_async_ppo_trainer.yaml); "
            "did you mean 'async_training.staleness_threshold'?",
        ),
        (
            "main_generation",
            "rollout.tempratur=0.5",
            "unknown config key 'rollout.tempratur' (not in generation.yaml); "
            "did you mean 'rollout.temperature'?",
        ),
        (
            "main_eval",
            "data.pth=x.parquet",
            "unknown config key 'data.pth' (not in evaluation.yaml); did you mean 'data.path'?",
        ),
        (
            "sft_trainer",
            "+model.lora_rank=8",
            "unknown config key 'model.lora_rank' (not in sft_trainer.yaml)",
        ),
    ],
)
def test_every_hydra_entry_point_answers_a_misspelled_key(module, override, message, tmp_path):
    run = run_module(f"hybridflow.trainer.{module}", override, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr == f"hybridflow: error: invalid command line: {message}\n"


def test_hydra_full_error_keeps_the_traceback(tmp_path):
    run = run_module(
        "hybridflow.trainer.main_ppo",
        "actor_rollout_ref.rollout.temprature=0.7",
        cwd=tmp_path,
        full_error=True,
    )
    assert run.returncode != 0
    assert "Traceback" in run.stderr and f"ConfigError: invalid command line:\n  - {TYPO_FIX}" in run.stderr


def test_legitimate_additions_and_hydra_keys_pass_the_command_line_check():
    """verl's ``+`` additions under free-form sections (engine kwargs, wrap policies, reward kwargs),
    Hydra's own keys and deletions are left to Hydra and the validators, as before."""
    from hybridflow.trainer.config.mistakes import override_problems

    accepted = [
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=null",
        "+actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[Qwen2DecoderLayer]",
        "+reward_model.reward_kwargs.use_math_verify=true",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: bf16}",
        "trainer.resource_pool_spec={actor: [1], aux: [1]}",
        "hydra.run.dir=/tmp/run",
        "hydra.output_subdir=null",
        "~trainer.logger",
        "actor_rollout_ref.rollout.temperature=0.7",
    ]
    assert override_problems(accepted, "ppo_trainer") == []
    assert override_problems(["+rollout.extra=1"], "generation") == [
        "unknown config key 'rollout.extra' (not in generation.yaml)"
    ]


def test_load_config_names_the_nearest_key():
    with pytest.raises(ConfigError) as info:
        load_config(["actor_rollout_ref.rollout.temprature=0.7"])
    assert str(info.value) == f"invalid config:\n  - {TYPO_FIX}"


def test_a_misspelled_key_in_a_user_yaml_names_the_nearest_key(tmp_path, base_overrides):
    (tmp_path / "bad.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\ntrainer:\n  savefreq: 3\n")
    config = load_config(base_overrides, config_name="bad", config_dir=tmp_path)
    assert problems_of_config(config) == [
        "unknown config key 'trainer.savefreq' (not in ppo_trainer.yaml); did you mean 'trainer.save_freq'?"
    ]


def test_nearest_key():
    from hybridflow.trainer.config.mistakes import entry_schema, key_paths, nearest_key

    paths = key_paths(entry_schema("ppo_trainer"))
    assert (
        nearest_key("actor_rollout_ref.rolout.temperature", paths) == "actor_rollout_ref.rollout.temperature"
    )
    assert nearest_key("data.max_respone_length", paths) == "data.max_response_length"
    assert nearest_key("trainer.n_gpu_per_node", paths) == "trainer.n_gpus_per_node"
    assert nearest_key("completely.unrelated", paths) is None


# -------------------------------------------------------------------- sizes and counts that must be positive
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data.train_batch_size=-4",
            "data.train_batch_size=-4 must be a positive integer",
        ),  # was "not divisible"
        (
            "data.train_batch_size=-8",
            "data.train_batch_size=-8 must be a positive integer",
        ),  # was: Ray started
        ("data.train_batch_size=0", "data.train_batch_size=0 must be a positive integer"),
        ("actor_rollout_ref.rollout.n=-2", "actor_rollout_ref.rollout.n=-2 must be a positive integer"),
        ("data.train_batch_size=four", "data.train_batch_size='four' must be a positive integer"),
        ("data.val_batch_size=0", "data.val_batch_size=0 must be a positive integer (or null: unset)"),
        ("data.max_prompt_length=0", "data.max_prompt_length=0 must be a positive integer"),
        ("data.max_response_length=-1", "data.max_response_length=-1 must be a positive integer"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=0", "ppo_mini_batch_size=0 must be a positive integer"),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=-2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=-2 must be a positive integer "
            "(or null: unset)",
        ),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0 must be a positive integer",
        ),
        ("trainer.total_epochs=0", "trainer.total_epochs=0 must be a positive integer"),
        ("trainer.n_gpus_per_node=0", "trainer.n_gpus_per_node=0 must be a positive integer"),  # was a crash
        ("trainer.nnodes=-1", "trainer.nnodes=-1 must be a positive integer"),
    ],
)
def test_a_size_that_is_not_positive_is_named_with_its_value(base_overrides, override, message):
    """The one line is the right reason: no "not divisible" line for the same key, no crash in a check
    that divides by it."""
    assert message in the_one_problem([*base_overrides, override])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor_rollout_ref.model.enable_gradient_checkpointing=maybe", "='maybe' must be true or false"),
        ("actor_rollout_ref.rollout.calculate_log_probs=yes", "log_probs='yes' must be true or false"),
        ("data.shuffle=2", "data.shuffle=2 must be true or false"),
        ("actor_rollout_ref.actor.clip_ratio_c=high", "clip_ratio_c='high' must be a number"),
        ("data.truncation=sideways", "data.truncation='sideways' must be one of error, left, right, middle"),
        ("trainer.resume_mode=sometimes", "='sometimes' must be one of auto, disable, resume_path"),
        ("algorithm.kl_ctrl.type=exp", "kl_ctrl.type='exp' must be one of fixed, adaptive"),
        ("actor_rollout_ref.rollout.dtype=fp16", "='fp16' must be one of fp32, float32, bf16, bfloat16"),
    ],
)
def test_a_value_of_the_wrong_kind_or_outside_its_choices_is_refused(base_overrides, override, message):
    """A string where a boolean goes was true whatever it said; an unknown resume mode resumed as
    ``auto``; an unknown truncation, KL controller or rollout dtype failed in a worker after Ray started."""
    assert message in the_one_problem([*base_overrides, override])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor_rollout_ref.rollout.temperature=-1", "temperature=-1 must be >= 0 (0: greedy)"),
        ("actor_rollout_ref.rollout.val_kwargs.top_p=1.5", "top_p=1.5 must be in (0, 1]"),
        ("actor_rollout_ref.rollout.top_k=-5", "top_k=-5 must be -1 or 0 (off), or a positive integer"),
        ("actor_rollout_ref.rollout.top_k=0.5", "top_k=0.5 must be -1 or 0 (off)"),
        ("actor_rollout_ref.actor.clip_ratio_high=-0.28", "clip_ratio_high=-0.28 must be > 0"),
        ("actor_rollout_ref.actor.grad_clip=-1", "grad_clip=-1 must be > 0 (the largest gradient norm"),
        ("actor_rollout_ref.actor.optim.lr=-0.001", "lr=-0.001 must be >= 0"),
        ("algorithm.gamma=1.5", "algorithm.gamma=1.5 must be in [0, 1]"),
        ("algorithm.lam=fast", "algorithm.lam='fast' must be in [0, 1]"),
        ("actor_rollout_ref.rollout.max_num_seqs=0", "max_num_seqs=0 must be a positive integer"),
        ("actor_rollout_ref.rollout.block_size=-16", "block_size=-16 must be a positive integer (or null"),
        ("actor_rollout_ref.rollout.response_length=0", "response_length=0 must be a positive integer"),
        ("actor_rollout_ref.actor.kl_loss_coef=-1", "kl_loss_coef=-1 must be >= 0"),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=0", "ppo_max_token_len_per_gpu=0 must be > 0"),
        ("actor_rollout_ref.rollout.gpu_memory_utilization=1.5", "utilization=1.5 must be in (0, 1]"),
        ("actor_rollout_ref.rollout.gpu_memory_utilization=0", "utilization=0 must be in (0, 1]"),
        ("actor_rollout_ref.rollout.kv_cache_memory_gb=0", "kv_cache_memory_gb=0 must be null"),
        ("actor_rollout_ref.rollout.kv_cache_memory_gb=-2", "kv_cache_memory_gb=-2 must be null"),
    ],
)
def test_a_number_out_of_its_range_is_refused(base_overrides, override, message):
    """Before, these started Ray and failed in a worker, or ran wrong without a word (a negative
    grad_clip multiplies every gradient by a negative number: an ascent step; a KV share above 1 asks
    for more memory than the device has; a budget of 0 GiB fell back to the share)."""
    assert message in the_one_problem([*base_overrides, override])


def test_the_kv_cache_budget_bounds_are_inclusive_where_they_should_be(base_overrides):
    for fine in ("gpu_memory_utilization=1", "kv_cache_memory_gb=0.25"):
        validate_config(load_config([*base_overrides, f"actor_rollout_ref.rollout.{fine}"]))


def test_critic_sizes_are_checked_when_a_critic_is_built(base_overrides):
    critic = [*base_overrides, "critic.ppo_mini_batch_size=0"]
    validate_config(load_config(critic))  # GRPO: no critic
    assert problems_of([*critic, "algorithm.adv_estimator=gae"]) == [
        "critic.ppo_mini_batch_size=0 must be a positive integer"
    ]


def test_sizes_and_other_mistakes_are_listed_together(base_overrides, tmp_path):
    problems = problems_of(
        [
            *base_overrides,
            "data.train_batch_size=0",
            "actor_rollout_ref.rollout.n=-2",
            f"data.val_files={tmp_path}/missing.parquet",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",  # divisibility of the others is kept
        ]
    )
    assert problems[:2] == [
        "data.train_batch_size=0 must be a positive integer",
        "actor_rollout_ref.rollout.n=-2 must be a positive integer",
    ]
    assert any("missing.parquet' does not exist" in line for line in problems)
    assert not any("divisible" in line for line in problems)


def test_a_config_error_is_one_line_before_ray_starts(base_overrides, tmp_path):
    """Was an 8-line traceback under Hydra's banner ("Error executing job with overrides")."""
    run = run_module("hybridflow.trainer.main_ppo", *base_overrides, "data.train_batch_size=-4", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert (
        run.stderr
        == "hybridflow: error: invalid config: data.train_batch_size=-4 must be a positive integer\n"
    )
    assert "ready to train" not in run.stdout


def test_the_entry_wrapper_prints_a_config_error_in_one_line(capsys, monkeypatch):
    from omegaconf import OmegaConf

    from hybridflow.trainer.hydra_entry import hydra_entry

    @hydra_entry("ppo_trainer")
    def main(config):
        raise ConfigError("invalid config:\n  - a.b=1 is wrong\n  - c.d=2 is wrong")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as info:
        main(OmegaConf.create({}))
    assert info.value.code == 2
    assert (
        capsys.readouterr().err
        == "hybridflow: error: invalid config:\n  - a.b=1 is wrong\n  - c.d=2 is wrong\n"
    )
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError):
        main(OmegaConf.create({}))


# ---------------------------------------------------------------------------------------- hybridflow.serve
def test_serve_with_a_missing_model_directory_says_so(tmp_path):
    """Was a transformers traceback about repo ids."""
    run = run_module("hybridflow.serve", "--model", "/no/such/dir", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr == (
        "hybridflow.serve: error: --model /no/such/dir: the model directory does not exist "
        "(give a local Hugging Face model directory)\n"
    )
    run = run_module("hybridflow.serve", "--model", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr == (
        f"hybridflow.serve: error: --model {tmp_path}: the directory has no config.json "
        "(not a Hugging Face model directory)\n"
    )


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization=1.5 must be in (0, 1]"),
        (["--kv-cache-memory-gb", "0"], "--kv-cache-memory-gb=0 must be > 0"),
    ],
)
def test_serve_refuses_a_kv_budget_out_of_range(flag, message, capsys):
    from hybridflow.serve.__main__ import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", "/no/such/dir", *flag])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert parse_args(["--model", "m", "--gpu-memory-utilization", "1"]).gpu_memory_utilization == 1
