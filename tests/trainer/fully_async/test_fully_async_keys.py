"""No key silently ignored by ``fully_async_main``: every key its YAML adds (``data.gen_batch_size``,
``rollout.*``, ``async_training.*``) and every ``algorithm.*`` and ``actor_rollout_ref.rollout.*`` key
its trainer reads, set to a value other than its default, either changes what the run uses or is refused
before Ray starts (``check_config``: the fully-async checks, then the PPO view's).

- :data:`REFUSED`: the settings refused, with the words of the refusal;
- :data:`READ`: honoured keys checked here cheaply — the value reaches the code that uses it (the
  trainer's own advantage and correction phases, the replicas' engine and serve defaults, the agent
  loops' sampling, limits and reward, the pools and the run length), changed against the default;
- :data:`SHOWN`: honoured keys whose effect a named test shows (the test must exist);
- ``test_every_key_is_classified``: a key added to one of those sections must join a table.

A key that only acts together with another (``lam`` with ``gae``, ``kl_coef`` with
``use_kl_in_reward``, ``rollout_is_threshold`` with ``rollout_is``) is set with that key (the context).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import hybridflow.trainer.config as config_module
from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.fully_async.main import admission_bound, check_config
from tests.tiny_run import tiny_run_values

REPO = Path(__file__).resolve().parents[3]
SECTIONS = ("algorithm", "actor_rollout_ref.rollout", "rollout", "async_training")
RECOMPUTE = {"async_training.use_rollout_log_probs": False}  # old log-probs recomputed: correction applies


@pytest.fixture(scope="module")
def check(vllm_model_dir, arithmetic_data):
    """``check(settings)``: ``(config, checked PPO view)`` of a tiny fully-async config with ``settings``
    (``{dotted key: value}``, ``+key`` to add one); ConfigError when refused."""
    base_values = tiny_run_values(vllm_model_dir, arithmetic_data, **{"trainer.n_gpus_per_node": 1})
    base = load_config([f"{k}={v}" for k, v in base_values.items()], config_name="fully_async_ppo_trainer")
    cache: dict = {}
    schema = config_module.load_schema()  # read once here: validate_config reads it on every call

    def run(settings: dict):
        key = repr(sorted(settings.items(), key=str))
        if key not in cache:
            config = OmegaConf.create(OmegaConf.to_container(base))  # unresolved, as composed
            OmegaConf.set_struct(config, True)
            for dotted, value in settings.items():
                OmegaConf.update(config, dotted.lstrip("+"), value, force_add=dotted.startswith("+"))
            cache[key] = (config, check_config(config))
        return cache[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config_module, "load_schema", lambda: schema)
        yield run


A = "algorithm."
C = "algorithm.rollout_correction."
R = "actor_rollout_ref.rollout."
CE = "async_training.checkpoint_engine."
REFUSED = [
    ({R + "trace.backend": "jsonl"}, r"rollout trace is not wired into fully_async_main"),
    ({R + "trace.token2text": True}, r"trace\.token2text=True: the rollout trace is not wired"),
    ({R + "trace.max_samples_per_step_per_worker": 2}, r"trace\.max_samples_per_step_per_worker=2"),
    ({R + "trace.dir": "/tmp/traces"}, r"trace\.dir=/tmp/traces: the rollout trace"),
    # verl's profiler: the rollouter's replicas are not profiled (profiler_honesty.py)
    ({R + "profiler.enable": True}, r"profiler\.enable=true: fully_async_main does not profile"),
    *(
        (
            {R + f"profiler.{leaf}": value},
            rf"profiler\.{re.escape(leaf)}=.*: fully_async_main does not profile",
        )
        for leaf, value in (
            ("tool", "torch"),
            ("all_ranks", True),
            ("ranks", [1]),
            ("save_path", "/tmp/profile"),
            ("tool_config.torch.contents", ["cpu"]),
            ("tool_config.torch.discrete", True),
            ("tool_config.nsys.discrete", True),
            ("tool_config.torch_memory.trace_alloc_max_entries", 5),
            ("tool_config.torch_memory.stack_depth", 5),
        )
    ),
    ({A + "filter_groups.enable": True}, r"algorithm\.filter_groups=.*not supported by fully_async_main"),
    ({A + "filter_groups.metric": "score"}, r"algorithm\.filter_groups=.*DAPO dynamic sampling"),
    ({A + "filter_groups.max_num_gen_batches": 3}, r"algorithm\.filter_groups=.*main_ppo"),
    ({C + "rollout_is": "token"}, r"every importance weight would be 1"),
    (
        {C + "rollout_rs": "token_k1", C + "rollout_rs_threshold": "0.5_2.0"},
        r"rejection\s+would remove nothing",
    ),
    ({A + "adv_estimator": "remax"}, r"adv_estimator=remax needs a greedy response"),
    ({A + "use_pf_ppo": True}, r"use_pf_ppo=True is not supported"),
    ({"data.gen_batch_size": 2}, r"data\.gen_batch_size=2 is not supported"),
    ({R + "mode": "sync"}, r"rollout\.mode='sync' is not supported"),
    ({R + "name": "hf"}, r"rollout\.name=hf has no engine to serve requests"),
    ({R + "name": "sglang"}, r"rollout\.name=sglang is not supported"),
    ({R + "free_cache_engine": True}, r"free_cache_engine=True is not supported"),
    ({R + "calculate_log_probs": False}, r"needs\s+actor_rollout_ref\.rollout\.calculate_log_probs"),
    ({R + "use_rollout_log_probs": True}, r"use_rollout_log_probs=true .* does nothing here"),
    ({R + "log_prob_parity_tolerance": 0.1}, r"log_prob_parity_tolerance=0\.1 is only read"),
    ({R + "log_prob_parity_check_freq": 3}, r"log_prob_parity_check_freq=3 is only read"),
    ({R + "decode_threads": 2}, r"decode_threads=2 splits one batch call"),
    ({R + "tensor_model_parallel_size": 2}, r"tensor_model_parallel_size must be 1"),
    ({R + "enable_chunked_prefill": True}, r"enable_chunked_prefill=True is not supported"),
    ({R + "disable_log_stats": False}, r"disable_log_stats=False is not supported"),
    ({"+" + R + "engine_kwargs.sglang.x": 1}, r"engine_kwargs=.* is not supported"),
    # verl's checkpoint engine (hybridflow/trainer/config/checkpoint_engine.py)
    ({R + "checkpoint_engine.backend": "nccl"}, r"backend=nccl does not run on cpu; use one of gloo, object"),
    ({R + "checkpoint_engine.backend": "naive"}, r"backend=naive: here trainer and rollout are separate"),
    ({R + "checkpoint_engine.backend": "nixl"}, r"backend='nixl' is unknown; registered: gloo, naive, nccl"),
    ({"+" + R + "checkpoint_engine.engine_kwargs.gloo.x": 1}, r"engine_kwargs\.gloo has \['x'\]; gloo takes"),
    ({CE + "overlap_broadcast_and_consume": True}, r"overlap_broadcast_and_consume=true is not implemented"),
    (
        {CE + "enable": False, R + "checkpoint_engine.backend": "gloo"},
        r"enable=false moves the weights through Ray's object store, but .*backend=gloo",
    ),
    (
        {R + "checkpoint_engine.update_weights_bucket_megabytes": 8, CE + "device_buffer_size_M": 16},
        r"update_weights_bucket_megabytes=8 and .*device_buffer_size_M=16 both size the bucket",
    ),
    ({"rollout.total_rollout_steps": 100, "trainer.total_training_steps": 3}, r"are both set"),
    ({"rollout.nnodes": 0}, r"rollout\.nnodes and rollout\.n_gpus_per_node must be >= 1"),
    ({"async_training.staleness_threshold": -1}, r"staleness_threshold must be >= 0"),
    ({"async_training.trigger_parameter_sync_step": 0}, r"trigger_parameter_sync_step must be >= 1"),
    ({"async_training.require_batches": 0}, r"require_batches must be >= 1"),
    ({"async_training.compute_prox_log_prob": True}, r"compute_prox_log_prob=true corrects"),
    (
        {"async_training.compute_prox_log_prob": True, "async_training.use_rollout_log_probs": False},
        r"compute_prox_log_prob=true does nothing with use_rollout_log_probs=false",
    ),
]


@pytest.mark.parametrize(("settings", "words"), REFUSED, ids=[" ".join(s) for s, _ in REFUSED])
def test_refused_before_ray_starts(check, settings, words):
    with pytest.raises(ConfigError) as refused:
        check(settings)
    assert re.search(words, str(refused.value), re.DOTALL), str(refused.value)


def test_the_defaults_and_the_documented_recipe_pass(check):
    check({})
    check({"async_training.compute_prox_log_prob": True, "algorithm.rollout_correction.rollout_is": "token"})
    check({**RECOMPUTE, "algorithm.rollout_correction.rollout_is": "token"})


# -------------------------------------------------------------------- honoured: the value reaches its reader
def _advantages(view) -> tuple:
    """The fully-async trainer's own advantage phase on a fixed batch: (advantages, KL coefficient)."""
    from hybridflow.algorithms import get_kl_controller
    from hybridflow.trainer.fully_async.trainer import FullyAsyncTrainer
    from hybridflow.trainer.ppo.ray_trainer import _kl_ctrl_kwargs

    trainer = object.__new__(FullyAsyncTrainer)
    trainer.config = view
    trainer.kl_ctrl = get_kl_controller(**_kl_ctrl_kwargs(view.algorithm.kl_ctrl))
    generator = torch.Generator().manual_seed(0)
    rows, length = 4, 5
    batch = DataProto.from_dict(
        {
            keys.TOKEN_LEVEL_SCORES: torch.rand(rows, length, generator=generator),
            keys.RESPONSE_MASK: torch.ones(rows, length),
            keys.VALUES: torch.rand(rows, length, generator=generator),
            keys.OLD_LOG_PROBS: -torch.rand(rows, length, generator=generator),
            keys.REF_LOG_PROB: -torch.rand(rows, length, generator=generator),
        },
        non_tensors={keys.UID: np.array(["a", "a", "b", "b"], dtype=object)},
    )
    out = trainer.compute_advantage(batch, {})
    return out.batch[keys.ADVANTAGES].tolist(), trainer.kl_ctrl.value


def _correction(view) -> tuple:
    """The fully-async trainer's own decoupled correction on a fixed batch: (IS weights, mask) — or,
    in bypass mode, the policy loss the actor is given."""
    from hybridflow.algorithms.rollout_correction import RolloutCorrection
    from hybridflow.trainer.fully_async.trainer import FullyAsyncTrainer

    policy_loss = OmegaConf.to_container(view.actor_rollout_ref.actor.policy_loss, resolve=True)
    trainer = object.__new__(FullyAsyncTrainer)
    trainer.rollout_correction = RolloutCorrection.from_config(view.algorithm.rollout_correction)
    if trainer.rollout_correction is None:
        return "no correction"
    if trainer.rollout_correction.bypass_mode:
        return policy_loss
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 6, generator=generator) * 2
    batch = DataProto.from_dict(
        {
            keys.OLD_LOG_PROBS: old,
            keys.ROLLOUT_LOG_PROBS: old + torch.randn(4, 6, generator=generator),
            keys.RESPONSE_MASK: torch.ones(4, 6, dtype=torch.long),
        }
    )
    trainer.correct_for_the_rollout(batch, {})
    weights = batch.batch.get(keys.ROLLOUT_IS_WEIGHTS, None)
    return (None if weights is None else weights.tolist()), batch.batch[keys.RESPONSE_MASK].tolist()


def _engine(view) -> dict:
    """What a rollouter replica's engine is built with (``build_llm_engine`` on the view's rollout)."""
    import hybridflow.workers.rollout.engine_rollout as engine_rollout

    class Recorded(dict):
        def __init__(self, model, **kwargs):
            super().__init__(kwargs)

    class Model:
        device, spec, dtype = torch.device("cpu"), None, torch.float32

        class shard:  # noqa: N801  (the attribute the builder reads)
            parallel = False

    saved = engine_rollout.LLMEngine, engine_rollout.blocks_for_budget
    engine_rollout.LLMEngine = Recorded
    # blocks: the budget in GiB x 16, under the max_num_seqs x max_model_len cap, so a budget key shows
    engine_rollout.blocks_for_budget = lambda spec, block_size, dtype, budget, max_len: budget // 2**26
    try:
        rollout = view.actor_rollout_ref.rollout
        built = dict(engine_rollout.build_llm_engine(Model(), rollout))
        built["dtype"] = engine_rollout.engine_dtype(rollout.get("dtype"), "cpu")
        return built
    finally:
        engine_rollout.LLMEngine, engine_rollout.blocks_for_budget = saved


def _serve_defaults(view):
    from hybridflow.workers.rollout.engine_rollout import engine_sampling_params

    return engine_sampling_params(view.actor_rollout_ref.rollout, {}, [2])


def _sampling(validate: bool):
    def read(view) -> dict:
        from hybridflow.workers.rollout.agent_loop.worker import loop_sampling_params
        from hybridflow.workers.rollout.base import sampling_params

        rollout = view.actor_rollout_ref.rollout
        meta = {"validate": validate}
        return {
            **loop_sampling_params(rollout, meta),
            "do_sample": sampling_params(rollout, meta)["do_sample"],
        }

    return read


def _loops(view) -> tuple:
    """The agent loops' settings: the default loop, the multi-turn limits and parser, the reward."""
    from hybridflow.workers.rollout.agent_loop.worker import AgentLoopWorker, default_agent_loop
    from hybridflow.workers.rollout.multi_turn import MultiTurnLimits
    from hybridflow.workers.rollout.tools.parser import get_tool_call_parser

    rollout = view.actor_rollout_ref.rollout
    worker = object.__new__(AgentLoopWorker)
    worker.config, worker.tokenizer = view, None
    return (
        default_agent_loop(rollout),
        MultiTurnLimits.from_rollout_config(rollout),
        type(get_tool_call_parser(str(rollout.multi_turn.format))).__name__,
        worker._reward_fn() is None,  # scored in the loop, or by the trainer after the rollout
    )


def _log_prob_pass(view) -> tuple:
    """How the trainer's actor splits a log-prob pass (the recompute and the sync probe)."""
    from hybridflow.workers.micro_batch import split_micro_batches

    rollout = view.actor_rollout_ref.rollout
    data = DataProto.from_dict({keys.ATTENTION_MASK: torch.ones(8, 6, dtype=torch.long)})
    per_gpu = rollout.log_prob_micro_batch_size or rollout.log_prob_micro_batch_size_per_gpu
    parts, _ = split_micro_batches(
        data, per_gpu, bool(rollout.log_prob_use_dynamic_bsz), rollout.log_prob_max_token_len_per_gpu
    )
    return [len(p) for p in parts]


def _run_shape(config, view) -> tuple:
    from hybridflow.trainer.config.async_honesty import recomputes_old_log_probs

    return (
        admission_bound(config),
        int(view.data.train_batch_size),
        view.trainer.total_training_steps,
        view.trainer.test_freq,
        recomputes_old_log_probs(config),
        int(config.actor_rollout_ref.rollout.n),
    )


def _weight_sync(config, view):
    """What the trainer's checkpoint engine gets: backend, bucket, engine kwargs."""
    from hybridflow.trainer.config.checkpoint_engine import fully_async_checkpoint_engine

    return fully_async_checkpoint_engine(config)


def _pool(config, view) -> list:
    import hybridflow.single_controller.ray as ray_module
    from hybridflow.trainer.fully_async.main import build_rollout_group

    saved = ray_module.RayResourcePool, ray_module.RayWorkerGroup
    ray_module.RayResourcePool = lambda process_on_nodes, **kwargs: process_on_nodes
    ray_module.RayWorkerGroup = lambda pool, *args, **kwargs: pool
    try:
        return build_rollout_group(config, view)
    finally:
        ray_module.RayResourcePool, ray_module.RayWorkerGroup = saved


def _probe_limit(view):
    from hybridflow.trainer.ppo.ray_trainer import computes_in_fp32
    from hybridflow.utils.rollout_parity import gap_limit

    return gap_limit(view.actor_rollout_ref.rollout, computes_in_fp32(view))


def _backend(view):
    from hybridflow.workers.rollout.base import get_rollout_cls

    return get_rollout_cls(view.actor_rollout_ref.rollout.name).__name__


ALGO, CORR = A, C
GAE = {"algorithm.adv_estimator": "gae"}
KL = {"algorithm.use_kl_in_reward": True}
ADAPTIVE = {**KL, "algorithm.kl_ctrl.type": "adaptive"}
TOKEN_IS = {**RECOMPUTE, CORR + "rollout_is": "token"}
BYPASS = {CORR + "bypass_mode": True}
RS = {**RECOMPUTE, CORR + "rollout_rs": "token_k1"}
VAL_SAMPLING = {R + "val_kwargs.do_sample": True, R + "val_kwargs.temperature": 1.0}
# key -> (non-default value, context settings, reader(view) or reader(config, view))
READ = {
    ALGO + "gamma": (0.5, GAE, _advantages),
    ALGO + "lam": (0.5, GAE, _advantages),
    ALGO + "adv_estimator": ("rloo", {}, _advantages),
    ALGO + "norm_adv_by_std_in_grpo": (False, {}, _advantages),
    ALGO + "use_kl_in_reward": (True, {}, _advantages),
    ALGO + "kl_penalty": ("abs", KL, _advantages),
    ALGO + "kl_ctrl.type": ("adaptive", KL, _advantages),
    ALGO + "kl_ctrl.kl_coef": (0.5, KL, _advantages),
    ALGO + "kl_ctrl.horizon": (10, ADAPTIVE, _advantages),
    ALGO + "kl_ctrl.target_kl": (0.001, ADAPTIVE, _advantages),
    CORR + "rollout_is": ("sequence", RECOMPUTE, _correction),
    CORR + "rollout_is_threshold": (1.1, TOKEN_IS, _correction),
    CORR + "rollout_is_batch_normalize": (True, TOKEN_IS, _correction),
    CORR + "rollout_rs": ("token_k1", {**RECOMPUTE, CORR + "rollout_rs_threshold": "0.5_2.0"}, _correction),
    CORR + "rollout_rs_threshold": ("0.9_1.1", {**RS, CORR + "rollout_rs_threshold": "0.5_2.0"}, _correction),
    CORR + "bypass_mode": (True, {}, _correction),
    CORR + "loss_type": ("reinforce", BYPASS, _correction),
    R + "name": ("vllm", {}, _backend),
    R + "agent.default_agent_loop": ("tool_agent", {}, _loops),
    R + "agent.reward_in_loop": (False, {}, _loops),
    R + "temperature": (0.7, {}, _sampling(False)),
    R + "top_k": (5, {}, _sampling(False)),
    R + "top_p": (0.9, {}, _sampling(False)),
    R + "do_sample": (False, {}, _sampling(False)),
    R + "calculate_log_probs": (False, RECOMPUTE, _sampling(False)),
    R + "n": (4, {}, _run_shape),
    R + "prompt_length": (60, {}, _engine),
    R + "response_length": (12, {}, _serve_defaults),
    R + "dtype": ("bf16", {}, _engine),
    R + "ignore_eos": (True, {}, _serve_defaults),
    R + "seed": (7, {}, _engine),
    R + "max_num_seqs": (8, {}, _engine),
    R + "max_num_batched_tokens": (512, {}, _engine),
    R + "enable_prefix_caching": (False, {}, _engine),
    R + "block_size": (32, {}, _engine),
    R + "max_model_len": (64, {}, _engine),
    R + "decode_steps_per_sync": (4, {}, _engine),
    R + "enforce_eager": (True, {}, _engine),
    R + "cudagraph_capture_sizes": ([1, 2, 4], {}, _engine),
    R + "gpu_memory_utilization": (0.1, {}, _engine),
    R + "kv_cache_memory_gb": (0.25, {}, _engine),
    R + "log_prob_gap_limit": (0.5, {}, _probe_limit),
    R + "log_prob_micro_batch_size": (2, {}, _log_prob_pass),
    R + "log_prob_micro_batch_size_per_gpu": (3, {}, _log_prob_pass),
    R + "log_prob_use_dynamic_bsz": (True, {R + "log_prob_max_token_len_per_gpu": 12}, _log_prob_pass),
    R + "log_prob_max_token_len_per_gpu": (18, {R + "log_prob_use_dynamic_bsz": True}, _log_prob_pass),
    R + "val_kwargs.top_k": (5, VAL_SAMPLING, _sampling(True)),
    R + "val_kwargs.top_p": (0.9, VAL_SAMPLING, _sampling(True)),
    R + "val_kwargs.temperature": (0.5, VAL_SAMPLING, _sampling(True)),
    R + "val_kwargs.do_sample": (True, {R + "val_kwargs.temperature": 0.5}, _sampling(True)),
    R + "multi_turn.enable": (True, {}, _loops),
    R + "multi_turn.max_assistant_turns": (3, {}, _loops),
    R + "multi_turn.max_user_turns": (2, {}, _loops),
    R + "multi_turn.max_parallel_calls": (2, {}, _loops),
    R + "multi_turn.max_tool_response_length": (64, {}, _loops),
    R + "multi_turn.tool_response_truncate_side": ("left", {}, _loops),
    R + "multi_turn.tool_timeout_s": (5, {}, _loops),
    "rollout.nnodes": (2, {}, _pool),
    "rollout.n_gpus_per_node": (2, {}, _pool),
    "rollout.total_rollout_steps": (40, {}, _run_shape),
    "rollout.test_freq": (2, {}, _run_shape),
    "async_training.staleness_threshold": (1, {}, _run_shape),
    "async_training.trigger_parameter_sync_step": (2, {}, _run_shape),
    "async_training.require_batches": (2, {}, _run_shape),
    "async_training.use_rollout_log_probs": (False, {}, _run_shape),
    R + "checkpoint_engine.backend": ("object_store", {}, _weight_sync),
    R + "checkpoint_engine.update_weights_bucket_megabytes": (8, {}, _weight_sync),
    # a dict: added with +
    "+" + R + "checkpoint_engine.engine_kwargs": ({"gloo": {"timeout_s": 5}}, {}, _weight_sync),
    CE + "enable": (False, {}, _weight_sync),
    CE + "device_buffer_size_M": (8, {}, _weight_sync),
}


@pytest.mark.parametrize("key", sorted(READ))
def test_an_honoured_key_changes_what_its_reader_gets(check, key):
    value, context, reader = READ[key]
    if key == R + "name":
        from hybridflow.workers.rollout.vllm_rollout import vllm_unavailable_reason

        if vllm_unavailable_reason("cpu") is not None:
            pytest.skip(f"rollout.name=vllm: {vllm_unavailable_reason('cpu')}")
    default = check(context)
    changed = check({**context, key: value})

    def read(checked):
        config, view = checked
        return reader(config, view) if reader in (_run_shape, _pool, _weight_sync) else reader(view)

    assert read(changed) != read(default), f"{key}={value} did not change what the run uses"


# ---------------------------------------------------------------------- honoured: a named test shows it
E2E = "tests/trainer/fully_async/test_fully_async_e2e.py::"
AGENT_E2E = "tests/trainer/ppo/test_agent_loop_e2e.py::"
PHASES = "tests/trainer/ppo/test_trainer_rollout_phases.py::"
SHOWN = {
    R + "agent.num_workers": AGENT_E2E + "test_async_samples_and_trains_like_sync",
    R + "agent.agent_loop_config_path": E2E
    + "test_slow_samples_and_slow_updates_keep_the_bound_and_the_data",
    R + "agent.generate_timeout_s": AGENT_E2E + "test_a_rank_dying_mid_rollout_is_an_error_naming_it",
    # main_ppo's parity-checked shortcut, with a recompute (async_training.use_rollout_log_probs=false)
    R + "use_rollout_log_probs": PHASES
    + "test_parity_is_checked_again_every_freq_steps_and_a_failure_recomputes",
    R + "log_prob_parity_tolerance": "tests/utils/test_rollout_parity_limits.py::"
    "test_tolerance_is_the_backends_unless_configured",
    R + "log_prob_parity_check_freq": PHASES
    + "test_parity_is_checked_again_every_freq_steps_and_a_failure_recomputes",
    # the replica loads the model, then takes the trainer's weights before its first request: any
    # load format gives the same rollout (vLLM honours it for its start-up load)
    R + "load_format": "tests/trainer/test_config.py::test_delivered_verl_settings_are_accepted",
    R + "engine_kwargs": "tests/trainer/test_vllm_config.py",  # vllm: passed to vLLM; engine: refused
    R + "val_kwargs.n": PHASES + "test_do_sample_false_gives_n_identical_greedy_responses",
    R + "multi_turn.tool_config_path": "tests/workers/rollout/test_engine_rollout.py",
    R + "multi_turn.format": "tests/workers/rollout/tools/test_parser_registry.py",
    R + "multi_turn.interaction_config_path": "tests/workers/rollout/test_interactions.py::"
    "test_tool_agent_loop_runs_the_configured_interaction_until_it_stops",
    "async_training.partial_rollout": E2E + "test_stale_partial_rollouts_with_token_is",
    R + "max_replica_restarts": E2E
    + "test_a_killed_rollout_replica_is_replaced_and_every_prompt_is_trained_once",
    # router replay R3: the replicas record, the samples carry routed_experts into the trainer's batch
    # (on an MoE model; the tiny dense model here is refused: router_replay_honesty.py)
    R + "enable_rollout_routing_replay": "tests/workers/rollout/test_server_routed_experts.py::"
    "test_fully_async_groups_carry_routed_experts_into_the_trainers_batch",
    # image rows (a vision-language model: refused with rollout.mode=async, vision_honesty.py)
    R + "limit_images": "tests/vlm/test_vlm_data.py::test_per_image_pixel_bounds_and_limit_images",
}
# keys of the schema that are no settings (hydra targets, YAML-only sections)
NOT_SETTINGS = {ALGO + "_target_", ALGO + "kl_ctrl._target_"}


def test_the_named_tests_exist():
    for key, node in SHOWN.items():
        path, _, name = node.partition("::")
        text = (REPO / path).read_text()
        assert not name or f"def {name}(" in text, f"{key}: {node} not found"


def _leaves(node, prefix: str) -> list[str]:
    found = []
    for key, value in node.items():
        path = f"{prefix}.{key}"
        if OmegaConf.is_dict(value) and len(value) and key != "engine_kwargs":
            found += _leaves(value, path)
        else:
            found.append(path)
    return found


def test_every_key_is_classified():
    """Each leaf of the sections is refused (at a non-default value), read, or shown by a test."""
    config = load_config([], config_name="fully_async_ppo_trainer")
    refused = {key.lstrip("+").replace(".sglang.x", "") for settings, _ in REFUSED for key in settings}
    read = {key.lstrip("+") for key in READ}
    classified = refused | read | set(SHOWN) | NOT_SETTINGS | {"data.gen_batch_size"}
    leaves = [leaf for section in SECTIONS for leaf in _leaves(OmegaConf.select(config, section), section)]
    missing = sorted(set(leaves) - classified)
    assert not missing, f"keys neither refused nor shown to act in fully_async_main: {missing}"
