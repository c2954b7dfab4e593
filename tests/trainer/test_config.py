"""The config is checked as a whole before Ray starts: each problem is named in one error."""

import pytest

from hybridflow.trainer.config import ConfigError, load_config, validate_config


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


# ---------------------------------------------------------------- honest config (issue 12)
# verl keys whose effect hybridflow does not deliver: any value but the delivered one is an error naming
# the key, the value and what to do instead.
REJECTED = [
    ("data.use_shm=true", "data.use_shm=True is not supported"),
    ("actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.hybrid_engine=False is not supported"),
    ("actor_rollout_ref.model.enable_activation_offload=true", "use model.enable_gradient_checkpointing"),
    ("actor_rollout_ref.model.use_shm=true", "model.use_shm=True is not supported"),
    ("actor_rollout_ref.model.use_liger=true", "model.use_liger=True is not supported"),
    ("actor_rollout_ref.model.use_fused_kernels=true", "model.use_fused_kernels=True is not supported"),
    ("actor_rollout_ref.actor.use_torch_compile=true", "actor.use_torch_compile=True is not supported"),
    ("actor_rollout_ref.ref.use_torch_compile=true", "ref.use_torch_compile=True is not supported"),
    (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=3",
        "actor.ulysses_sequence_parallel_size=3 does not divide the role's 2 worker processes",
    ),
    ("critic.ulysses_sequence_parallel_size=0", "critic.ulysses_sequence_parallel_size=0 must be a positive"),
    ("actor_rollout_ref.actor.strategy=megatron", "actor.strategy='megatron' is not supported: only FSDP2"),
    ("reward_model.strategy=megatron", "reward_model.strategy='megatron' is not supported"),
    ("actor_rollout_ref.rollout.mode=server", "rollout.mode='server': use sync or async"),
    (
        "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
        "rollout.tensor_model_parallel_size=3 does not divide the role's 2 worker processes",
    ),
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes=[0,8]", "must be null or a list of ints >= 1"),
    ("actor_rollout_ref.rollout.enable_chunked_prefill=true", "prefills whole prompts"),
    ("actor_rollout_ref.rollout.disable_log_stats=false", "rollout.disable_log_stats=False is not supported"),
    ("reward_model.launch_reward_fn_async=true", "reward_model.launch_reward_fn_async=True"),
    ("algorithm.use_pf_ppo=true", "PF-PPO"),
    ("trainer.default_hdfs_dir=/hdfs/x", "there is no HDFS upload"),
    ("trainer.del_local_ckpt_after_load=true", "a loaded checkpoint is never deleted"),
    ("trainer.esi_redundant_time=5", "use trainer.time_budget_minutes"),
    ("trainer.profile_steps=[1,2]", "trainer.profile_steps=[1, 2] is not supported"),
    ("actor_rollout_ref.actor.checkpoint.load_contents=[model]", "loading a subset is not implemented"),
    ("critic.checkpoint.load_contents=[model]", "critic.checkpoint.load_contents=['model'] differs"),
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]", "hybridflow.model_merger"),
    ("actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "fsdp_size=1 is not supported"),
    ("actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=1000", "min_num_params=1000"),
    ("actor_rollout_ref.actor.fsdp_config.shard_one_rank=maybe", "shard_one_rank='maybe': use true or false"),
    ("+actor_rollout_ref.ref.fsdp_config.wrap_policy.policy=size", "unknown keys ['policy']"),
    ("actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: fp8}", "param_dtype='fp8' is not"),
    (
        "actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: bf16, buffer_dtype: bf16}",
        "buffer_dtype='bf16' is not supported",
    ),
    ("actor_rollout_ref.actor.fsdp_config.mixed_precision={param: bf16}", "mixed_precision.param is unknown"),
    ("actor_rollout_ref.actor.fsdp_config.model_dtype=int4", "model_dtype='int4' is not a dtype"),
    ("critic.rollout_n=3", "critic.rollout_n=3 must equal actor_rollout_ref.rollout.n=2"),
    (
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
        "only engine_kwargs.vllm, with rollout.name=vllm",
    ),
    (
        "actor_rollout_ref.rollout.name=sglang",
        "rollout.name=sglang is not supported: SGLang's wheels need CUDA",
    ),
    ("trainer.logger=[console,swanlab]", "'swanlab' is not a tracker"),
    # verl's checkpoint engine: main_ppo's hybrid engine hands the weights over in place (naive)
    (
        "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
        "backend=gloo: here trainer and rollout share a process (main_ppo); use one of naive",
    ),
    (
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512",
        "update_weights_bucket_megabytes=512 does nothing in main_ppo",
    ),
    (
        "data.custom_cls.path=/no/such/dataset.py",
        "data.custom_cls.path: '/no/such/dataset.py' does not exist",
    ),
]


@pytest.mark.parametrize(("override", "message"), REJECTED, ids=[o for o, _ in REJECTED])
def test_undelivered_settings_are_rejected(base_overrides, override, message):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config([*base_overrides, override]))
    assert message in str(info.value)


@pytest.mark.parametrize("key", ["decode_threads", "decode_steps_per_sync", "block_size"])
def test_engine_only_keys_are_rejected_with_hf_generate(base_overrides, key):
    config = load_config(
        [*base_overrides, "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.rollout.{key}=2"]
    )
    with pytest.raises(
        ConfigError, match=f"rollout.{key} is the embedded engine's; HF generate does not read it"
    ):
        validate_config(config)
    validate_config(
        load_config([*base_overrides, f"actor_rollout_ref.rollout.{key}=2"])
    )  # the engine reads it


def test_rejections_are_listed_together(base_overrides):
    config = load_config(
        [*base_overrides, "actor_rollout_ref.rollout.mode=server", "trainer.del_local_ckpt_after_load=true"]
    )
    with pytest.raises(ConfigError) as info:
        validate_config(config)
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid config:"
    assert any("rollout.mode='server'" in line for line in lines[1:])
    assert any("del_local_ckpt_after_load=True" in line for line in lines[1:])


# verl values whose effect is delivered here (or that verl itself ignores): they keep running.
ACCEPTED = [
    "actor_rollout_ref.actor.strategy=fsdp",
    "data.return_raw_input_ids=true",
    "data.dataloader_num_workers=4",
    "data.filter_overlong_prompts_workers=4",
    "data.trust_remote_code=true",
    "actor_rollout_ref.model.trust_remote_code=true",
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.rollout.load_format=hf",
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=null",  # verl's unset default
    "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    "actor_rollout_ref.actor.fsdp_config.offload_policy=true",
    "actor_rollout_ref.ref.fsdp_config.param_offload=true",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision=auto",
    "+actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[Qwen2DecoderLayer]",
    "actor_rollout_ref.ref.fsdp_config.model_dtype=bf16",
    "reward_model.micro_batch_size=4",
    "reward_model.max_length=128",
    "trainer.ray_wait_register_center_timeout=10",
    "trainer.log_val_generations=3",
    "trainer.max_critic_ckpt_to_keep=2",
    "ray_init.timeline_json_file=/tmp/timeline.json",
]


@pytest.mark.parametrize("override", ACCEPTED)
def test_delivered_verl_settings_are_accepted(base_overrides, override):
    validate_config(load_config([*base_overrides, override]))


def test_bf16_master_weights_are_rejected_for_trained_models_only(base_overrides, tiny_model_dir):
    with pytest.raises(ConfigError) as info:
        validate_config(
            load_config([*base_overrides, "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"])
        )
    message = str(info.value)
    assert (
        "actor.fsdp_config.model_dtype=bf16 would keep the trained master weights and AdamW state" in message
    )
    assert "mixed_precision='{param_dtype: bf16, reduce_dtype: fp32}'" in message
    # the frozen reference follows the actor's model_dtype by default, and may be bf16 on its own
    assert "ref.fsdp_config.model_dtype" not in message
    # a LoRA actor trains only its adapter, which peft keeps in fp32 over the bf16 base
    validate_config(
        load_config(
            [
                *base_overrides,
                "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
                "actor_rollout_ref.model.lora_rank=8",
            ]
        )
    )
    critic = [*base_overrides, "critic.model.fsdp_config.model_dtype=bf16"]
    validate_config(load_config(critic))  # GRPO: no critic is built, its settings do not apply
    with pytest.raises(ConfigError, match="critic.model.fsdp_config.model_dtype=bf16 would keep"):
        validate_config(load_config([*critic, "algorithm.adv_estimator=gae"]))
    reward_model = [
        *base_overrides,
        "reward_model.enable=true",
        f"reward_model.model.path={tiny_model_dir}",
    ]
    validate_config(load_config([*reward_model, "reward_model.model.fsdp_config.model_dtype=bf16"]))


def test_startup_notes_name_what_runs(base_overrides, vllm_model_dir):
    from hybridflow.trainer.config.honesty import startup_notes

    assert startup_notes(load_config(base_overrides)) == []
    notes = startup_notes(
        load_config([*base_overrides, "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"])
    )
    assert len(notes) == 1 and "CPUOffloadPolicy keeps the parameters" in notes[0]


def test_every_yaml_key_is_implemented_or_limited():
    """Guard for new keys: a key the code never reads must be in honesty.LIMITED_VALUES or say in its YAML
    comment what delivers it ("accepted: ..."). The keys below are read through their section."""
    import re
    from pathlib import Path

    from hybridflow.trainer.config.honesty import ENGINE_LIMITED_VALUES, LIMITED_VALUES

    yaml_text = (Path(__file__).parents[2] / "hybridflow/trainer/config/ppo_trainer.yaml").read_text()
    assert "(accepted, unused)" not in yaml_text
    accepted = re.findall(r"^\s*(\w+):.*# accepted", yaml_text, flags=re.M)
    assert set(accepted) >= {"return_raw_input_ids", "dataloader_num_workers"}
    for key in LIMITED_VALUES:
        assert re.search(rf"^\s*{key.rsplit('.', 1)[-1]}:.*# only", yaml_text, flags=re.M), key
    for key in ENGINE_LIMITED_VALUES:  # limits of the embedded engine only (vLLM takes these keys)
        assert re.search(rf"^\s*{key.rsplit('.', 1)[-1]}:.*# engine: only", yaml_text, flags=re.M), key


def test_reward_kwargs_no_scorer_of_the_run_takes_are_rejected(base_overrides, arithmetic_data, tmp_path):
    """reward_model.reward_kwargs reach the built-in scorers of the data's sources (data.reward_fn_key of
    the train and val files); one that none of them takes is an error before anything starts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    math_kwarg = "+reward_model.reward_kwargs.use_math_verify=true"
    with pytest.raises(ConfigError) as info:
        validate_config(load_config([*base_overrides, math_kwarg]))
    (line,) = [line for line in str(info.value).splitlines() if "reward_kwargs" in line]
    assert "reward kwarg 'use_math_verify' is accepted by no scorer of this run's data sources" in line
    assert "lighteval/MATH" in line and "hybridflow/arithmetic accepts none" in line
    # validation rows from MATH: the MATH scorer takes it (the arithmetic rows simply do not get it)
    table = pq.read_table(arithmetic_data[1])
    math_val = tmp_path / "math_val.parquet"
    sources = pa.array(["lighteval/MATH"] * len(table))
    column = table.column_names.index("data_source")
    pq.write_table(table.set_column(column, "data_source", sources), math_val)
    validate_config(load_config([*base_overrides, math_kwarg, f"data.val_files={math_val}"]))
    # the prime manager keeps num_processes for itself: nothing reaches the scorers
    prime = ["reward_model.reward_manager=prime", "+reward_model.reward_kwargs.num_processes=1"]
    validate_config(load_config([*base_overrides, *prime]))
    # a custom reward function receives them instead: not the built-in scorers' business
    scorer = tmp_path / "reward.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, **kw):\n    return 0.0\n")
    validate_config(load_config([*base_overrides, math_kwarg, f"custom_reward_function.path={scorer}"]))


def test_entry_point_yamls_are_honest():
    """generation.yaml, evaluation.yaml and sft_trainer.yaml follow ppo_trainer.yaml's rule: no key is
    "(accepted, unused)"; each key with a limited set of values says "only" in its comment."""
    import re
    from pathlib import Path

    from hybridflow.trainer.config import honesty

    tables = {
        "generation.yaml": honesty.GENERATION_LIMITED_VALUES,
        "evaluation.yaml": honesty.EVALUATION_LIMITED_VALUES,
        "sft_trainer.yaml": honesty.SFT_LIMITED_VALUES,
    }
    for name, limited in tables.items():
        text = (Path(honesty.__file__).parent / name).read_text()
        assert "unused" not in text, name
        for key in limited:
            assert re.search(rf"^\s*{key.rsplit('.', 1)[-1]}:.*# only", text, flags=re.M), (name, key)


@pytest.mark.parametrize("eager", ["true", "false"])
def test_the_engine_takes_enforce_eager_either_way(base_overrides, eager):
    """false (verl's default) captures decode in CUDA graphs on CUDA and runs the same step eagerly on
    the CPU; true never captures."""
    validate_config(load_config([*base_overrides, f"actor_rollout_ref.rollout.enforce_eager={eager}"]))
    validate_config(
        load_config([*base_overrides, "actor_rollout_ref.rollout.cudagraph_capture_sizes=[1,2,4,8]"])
    )


def test_captured_decode_with_tensor_parallel_generation_is_refused_on_cuda():
    from omegaconf import OmegaConf

    from hybridflow.trainer.config.honesty import _engine_capture_problems

    config = OmegaConf.create(
        {"trainer": {"device": "cuda"}, "actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 2}}}
    )
    assert "set actor_rollout_ref.rollout.enforce_eager=true" in _engine_capture_problems(config)[0]
    config.actor_rollout_ref.rollout.enforce_eager = True
    assert _engine_capture_problems(config) == []
    config.actor_rollout_ref.rollout.enforce_eager = False
    config.trainer.device = "cpu"  # nothing is captured on the CPU
    assert _engine_capture_problems(config) == []


def test_an_interaction_class_that_does_not_import_is_refused_before_ray_starts(tmp_path, base_overrides):
    """``multi_turn.interaction_config_path`` (verl's YAML): each class is imported at validation; a
    file nothing would read (no multi-turn, no agent loops) is refused too."""
    key = "actor_rollout_ref.rollout.multi_turn"
    bad = tmp_path / "bad.yaml"
    bad.write_text("interaction:\n  - name: judge\n    class_name: my_pkg.judges.Judge\n")
    config = load_config([*base_overrides, f"{key}.enable=true", f"{key}.interaction_config_path={bad}"])
    with pytest.raises(
        ConfigError, match=r"interaction_config_path: .*interaction\[0\]: cannot import 'my_pkg"
    ):
        validate_config(config)
    good = tmp_path / "gsm8k.yaml"  # verl's examples/.../gsm8k_interaction_config.yaml, as it is
    good.write_text(
        'interaction:\n  - name: "gsm8k"\n'
        '    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"\n    config: {}\n'
    )
    validate_config(
        load_config([*base_overrides, f"{key}.enable=true", f"{key}.interaction_config_path={good}"])
    )
    unused = load_config([*base_overrides, f"{key}.interaction_config_path={good}"])
    with pytest.raises(ConfigError, match="interaction_config_path is set but nothing runs interactions"):
        validate_config(unused)


def test_a_verl_tool_we_do_not_have_is_refused_before_ray_starts(tmp_path, base_overrides):
    """``multi_turn.tool_config_path``: each entry's class is imported at validation (no tool is built and
    no server called: an MCP entry's servers file need only be there)."""
    key = "actor_rollout_ref.rollout.multi_turn"
    bad = tmp_path / "tools.yaml"
    bad.write_text(
        "tools:\n  - class_name: verl.tools.image_zoom_in_tool.ImageZoomInTool\n    config: {type: native}\n"
    )
    config = load_config([*base_overrides, f"{key}.enable=true", f"{key}.tool_config_path={bad}"])
    with pytest.raises(
        ConfigError, match=r"tool_config_path: .*tools\[0\]: .*ImageZoomInTool.* no counterpart"
    ):
        validate_config(config)
    (tmp_path / "mcp_server.json").write_text('{"mcpServers": {"x": {"url": "http://127.0.0.1:9/mcp"}}}')
    good = tmp_path / "mcp_tool_config.yaml"  # verl's, with its servers file beside it
    good.write_text(
        "tools:\n  - class_name: verl.tools.mcp_search_tool.MCPSearchTool\n"
        "    config: {rate_limit: 120, timeout: 120, type: mcp}\n"
        "    mcp: {mcp_servers_config_path: ./mcp_server.json, tool_selected_list: [tavily_search_tool]}\n"
    )
    validate_config(load_config([*base_overrides, f"{key}.enable=true", f"{key}.tool_config_path={good}"]))
