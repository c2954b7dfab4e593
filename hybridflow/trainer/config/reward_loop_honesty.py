"""What ``reward_model.use_reward_loop`` and its keys need, checked before Ray starts (issue 35).

- the loop on: ``reward_model.reward_manager`` (or the top-level ``reward_manager.name``) must be a
  reward-loop manager (``naive``, ``dapo``, ``rate_limited``/``limited`` or one registered into
  :mod:`hybridflow.workers.reward_loop.registry`); a served reward model in the loop
  (``reward_model.enable=true``) is started by main_ppo (:func:`served_rm_problems`: its engine keys
  ``reward_model.rollout.*``, its pool ``enable_resource_pool`` / ``n_gpus_per_node`` / ``nnodes``;
  standalone needs ``rollout.mode=async`` with ``reward_in_loop``);
- the loop off: the rate-limit keys and the top-level ``reward_manager`` section other than
  ``source=register`` have no reader, and are refused when set;
- the limits themselves: ``max_concurrent`` >= 1, ``max_rpm``/``max_tpm`` > 0 or null, ``timeout`` > 0,
  ``max_retries`` >= 0.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

LIMIT_DEFAULTS = {"max_concurrent": 1, "max_rpm": None, "max_tpm": None, "timeout": 300, "max_retries": 0}


def _get(config: DictConfig, key: str, default=None):
    value = OmegaConf.select(config, key, throw_on_missing=False, default=default)
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def _limit_problems(rm) -> list[str]:
    problems = []
    concurrent = rm.get("max_concurrent", 1)
    if not isinstance(concurrent, int) or isinstance(concurrent, bool) or concurrent < 1:
        problems.append(f"reward_model.max_concurrent={concurrent!r} must be an integer >= 1")
    for key in ("max_rpm", "max_tpm"):
        value = rm.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
        ):
            problems.append(f"reward_model.{key}={value!r} must be a positive number or null (no limit)")
    timeout = rm.get("timeout", 300)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        problems.append(f"reward_model.timeout={timeout!r} must be a positive number of seconds")
    retries = rm.get("max_retries", 0)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        problems.append(f"reward_model.max_retries={retries!r} must be an integer >= 0")
    return problems


def reward_loop_problems(config: DictConfig) -> list[str]:
    """One line per reward-loop setting hybridflow would not deliver (empty: all honest)."""
    from hybridflow.workers.reward_loop.registry import REWARD_LOOP_MANAGERS

    rm = _get(config, "reward_model") or {}
    section = _get(config, "reward_manager") or {}
    source = section.get("source", "register")
    name = section.get("name") or rm.get("reward_manager") or "naive"
    problems = _limit_problems(rm) + _sandbox_url_problems(config, rm)
    if source not in ("register", "importlib"):
        problems.append(f"reward_manager.source={source!r}: choose register or importlib")
    if source == "importlib" and not (section.get("module") or {}).get("path"):
        problems.append(
            "reward_manager.source=importlib needs reward_manager.module.path (the file; the class is "
            "reward_manager.name, as in verl's load_reward_manager)"
        )
    if not rm.get("use_reward_loop", False):
        changed = [k for k, default in LIMIT_DEFAULTS.items() if rm.get(k, default) != default]
        if changed:
            problems.append(
                f"reward_model.{', '.join(changed)} are read by the reward loop's limited manager: set "
                "reward_model.use_reward_loop=true and reward_model.reward_manager=limited"
            )
        if rm.get("reward_loop_source", "register") != "register":
            problems.append(
                "reward_model.reward_loop_source=importlib is read by the reward loop: set "
                "reward_model.use_reward_loop=true (or reward_manager.source=importlib for a batch manager)"
            )
        if rm.get("enable_resource_pool", False):
            problems.append(
                "reward_model.enable_resource_pool=true places a served reward model in the reward loop: set "
                "reward_model.use_reward_loop=true (the reward-model worker runs on the trainer's placement)"
            )
        if name in ("limited", "rate_limited"):
            problems.append(
                f"reward_model.reward_manager={name} scores in the reward loop: set "
                "reward_model.use_reward_loop=true"
            )
        return problems
    loop_source = rm.get("reward_loop_source", "register")
    if source == "register" and loop_source == "register" and name not in REWARD_LOOP_MANAGERS:
        problems.append(
            f"reward_model.reward_manager={name!r} is not a reward-loop manager (registered: "
            f"{', '.join(sorted(REWARD_LOOP_MANAGERS))}); set use_reward_loop=false for the batch managers"
        )
    problems += _loop_manager_problems(rm)
    if rm.get("batch_timeout_s", 1800) != 1800:
        problems.append(
            "reward_model.batch_timeout_s is read by the batch managers only: the reward loop limits each "
            "call (score_timeout_s; limited: timeout)"
        )
    if loop_source == "register" and source == "register":
        problems += _loop_reward_kwargs_problems(rm, name)
    workers = rm.get("num_workers", 1)
    if name != "remote" and workers != 1:
        problems.append(
            f"reward_model.num_workers={workers!r} is read by reward_manager=remote (its scoring processes); "
            f"with {name} only 1 (the loop runs in the trainer's reward phase and the agent-loop workers)"
        )
    elif not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        problems.append(f"reward_model.num_workers={workers!r} must be an integer >= 1")
    if name == "remote" and _get(config, "custom_reward_function.path"):
        problems += _remote_problems(config)
    limited = name in ("limited", "rate_limited")
    changed = [k for k, default in LIMIT_DEFAULTS.items() if rm.get(k, default) != default]
    if changed and not limited and source == "register" and loop_source == "register":
        problems.append(
            f"reward_model.{', '.join(changed)} are read only by reward_manager=limited (this run's: {name})"
        )
    if rm.get("enable", False):
        problems += served_rm_problems(config, rm)
    return problems


# reward_model.reward_kwargs that the reward loop reads: the served judge's address (main_ppo writes it),
# and what each registered manager reads itself (verl's reward loop passes none of them to compute_score)
LOOP_REWARD_KWARGS = ("reward_router_address",)


def loop_manager_reward_kwargs(name: str) -> tuple[str, ...]:
    """The ``reward_model.reward_kwargs`` keys the registered reward-loop manager ``name`` reads."""
    from hybridflow.workers.reward_manager.dapo import DAPO_REWARD_KWARGS

    return LOOP_REWARD_KWARGS + (DAPO_REWARD_KWARGS if name == "dapo" else ())


def _loop_reward_kwargs_problems(rm: dict, name: str) -> list[str]:
    read = loop_manager_reward_kwargs(name)
    unread = [k for k in rm.get("reward_kwargs") or {} if k not in read]
    if not unread:
        return []
    return [
        f"reward_model.reward_kwargs.{', '.join(unread)}: the reward loop's {name} manager passes "
        "reward_model.reward_kwargs to no reward function (verl's reward loop; it reads "
        f"{', '.join(read)}): give a function's own arguments as custom_reward_function.reward_kwargs.<key>"
    ]


def _sandbox_url_problems(config: DictConfig, rm: dict) -> list[str]:
    """``reward_model.sandbox_fusion.url`` reaches the built-in scorer of the batch managers only (verl's
    load_reward_manager): with the reward loop or a custom reward function nothing would call it."""
    if not (rm.get("sandbox_fusion") or {}).get("url"):
        return []
    if rm.get("use_reward_loop", False):
        return [
            "reward_model.sandbox_fusion.url is read by the batch reward managers (verl's "
            "load_reward_manager); the reward loop would not call it: set use_reward_loop=false, or call "
            "the server from a custom_reward_function (verl.utils.reward_score.sandbox_fusion.compute_score)"
        ]
    if _get(config, "custom_reward_function.path"):
        return [
            "reward_model.sandbox_fusion.url with custom_reward_function.path: the custom function scores, "
            "and the URL would not be called; pass it to your function "
            "(custom_reward_function.reward_kwargs) or unset custom_reward_function.path"
        ]
    return []


def _loop_manager_problems(rm: dict) -> list[str]:
    source = rm.get("reward_loop_source", "register")
    if source not in ("register", "importlib"):
        return [f"reward_model.reward_loop_source={source!r}: choose register or importlib"]
    if source == "register":
        return []
    missing = [k for k in ("reward_loop_module_path", "reward_loop_class_name") if not rm.get(k)]
    if missing:
        return [f"reward_model.reward_loop_source=importlib needs reward_model.{' and '.join(missing)}"]
    path = os.path.expanduser(str(rm["reward_loop_module_path"]))
    if not os.path.isfile(path):
        return [f"reward_model.reward_loop_module_path={path!r}: no such file"]
    return []


def _remote_problems(config: DictConfig) -> list[str]:
    """``remote`` runs sync reward functions in processes: an ``async def`` one is refused (verl's rule)."""
    from hybridflow.workers.reward_loop.base import is_async_function
    from hybridflow.workers.reward_manager.custom import _custom_compute_score

    try:
        function = _custom_compute_score(_get(config, "custom_reward_function"))
    except Exception:  # a missing file or name: reported by the custom function's own check
        return []
    if function is not None and is_async_function(function):
        return [
            "reward_model.reward_manager=remote runs synchronous reward functions in worker processes; "
            "custom_reward_function is async def: use reward_manager=naive or limited (verl's rule)"
        ]
    return []


# reward_model.rollout keys served as they are (python -m hybridflow.serve flags) or accepted at these values
SERVED_RM_LIMITED = {
    "cudagraph_capture_sizes": ((None,), "the served engine captures no CUDA graphs on the CPU"),
    "data_parallel_size": ((1,), "replicas come from the pool's size (n_gpus_per_node, or the trainer's)"),
    "expert_parallel_size": ((1,), "the served engine has no expert parallelism"),
    "tensor_model_parallel_size": ((1,), "a served replica is one process (no tensor parallelism)"),
    "load_format": (("auto",), "the judge's weights load from reward_model.model.path"),
    "engine_kwargs": (({},), "the served engine takes no extra engine arguments"),
    "limit_images": ((None,), "the judge serves text"),
    "enable_chunked_prefill": ((False,), "the engine prefills whole prompts"),
    "disable_log_stats": ((True,), "the served engine logs no periodic stats"),
    "skip_tokenizer_init": ((False,), "the judge's tokenizer serves the chat template (verl asserts false)"),
}
SERVED_DTYPES = {None: None, "fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def served_rm_problems(config: DictConfig, rm: dict) -> list[str]:
    """``reward_model.enable=true`` with the loop on: main_ppo serves ``model.path`` itself
    (:class:`hybridflow.workers.reward_loop.servers.RewardModelServers`); its pool and engine keys."""
    problems = []
    served = rm.get("rollout") or {}
    for key, (accepted, why) in SERVED_RM_LIMITED.items():
        value = served.get(key, accepted[0])
        if value not in accepted:
            problems.append(
                f"reward_model.rollout.{key}={value!r} is not supported ({why}); set {accepted[0]!r}"
            )
    if served.get("name", "engine") not in ("engine", "vllm"):
        problems.append(
            f"reward_model.rollout.name={served.get('name')!r}: the judge is served by engine or vllm"
        )
    colocated = not rm.get("enable_resource_pool", False)
    if served.get("name", "engine") == "vllm" and colocated and served.get("free_cache_engine", True):
        problems.append(
            "reward_model.rollout.name=vllm with free_cache_engine=true (colocated): vLLM-CPU has no sleep "
            "mode (its --enable-sleep-mode is refused on the CPU platform), so the judge could not release "
            "its KV cache between reward phases: set reward_model.rollout.free_cache_engine=false (it keeps "
            "the cache), or rollout.name=engine"
        )
    if served.get("dtype") not in SERVED_DTYPES:
        problems.append(f"reward_model.rollout.dtype={served.get('dtype')!r}: use null, fp32 or bf16")
    for key in ("max_num_batched_tokens", "max_num_seqs", "prompt_length", "response_length"):
        value = served.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"reward_model.rollout.{key}={value!r} must be an integer >= 1")
    fraction = served.get("gpu_memory_utilization", 0.5)
    if served.get("kv_cache_memory_gb") is None and not (
        isinstance(fraction, int | float) and 0 < fraction <= 1
    ):
        problems.append(f"reward_model.rollout.gpu_memory_utilization={fraction!r} must be in (0, 1]")
    path = os.path.expanduser(str((rm.get("model") or {}).get("path")))
    if not os.path.isdir(path):
        problems.append(
            f"reward_model.model.path={path!r} is not a model directory (the reward model to serve)"
        )
    elif not _get(config, "custom_reward_function.path"):
        from hybridflow.models.loading import is_sequence_classifier

        if not is_sequence_classifier(path):
            problems.append(
                "reward_model.enable=true serves a generative reward model: set custom_reward_function.path "
                "to a compute_score that asks it (it gets reward_router_address); only a sequence "
                "classifier (a DisRM) scores without one"
            )
    if _get(config, "async_training") is not None:
        problems.append(
            "reward_model.enable=true with use_reward_loop=true: fully_async_main does not start a served "
            "reward model (main_ppo does); start `python -m hybridflow.serve --model <RM>` and pass its "
            "address with reward_model.reward_kwargs.reward_router_address=<host:port>, enable=false"
        )
    kwargs = rm.get("reward_kwargs") or {}
    if kwargs.get("reward_router_address"):
        problems.append(
            "reward_model.reward_kwargs.reward_router_address with reward_model.enable=true: main_ppo starts "
            "the reward model and hands its own router's address; pass one or the other"
        )
    if not rm.get("enable_resource_pool", False):
        return problems
    rollout = _get(config, "actor_rollout_ref.rollout") or {}
    agent = rollout.get("agent") or {}
    if rollout.get("mode") != "async" or not agent.get("reward_in_loop", True):
        problems.append(
            "reward_model.enable_resource_pool=true (standalone) scores each sample in its agent loop as it "
            "finishes: set actor_rollout_ref.rollout.mode=async and rollout.agent.reward_in_loop=true "
            "(or enable_resource_pool=false: colocated, scored after the rollout)"
        )
    if rm.get("nnodes") != 1:
        problems.append(
            f"reward_model.nnodes={rm.get('nnodes')!r}: standalone needs 1 (the judge replicas start on the "
            "driver's machine)"
        )
    gpus = rm.get("n_gpus_per_node")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        problems.append(f"reward_model.n_gpus_per_node={gpus!r} must be an integer >= 1 (the replicas)")
    return problems
