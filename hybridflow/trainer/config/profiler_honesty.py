"""Honest config for verl's profiler keys: ``global_profiler`` and each role's ``profiler`` section.

What runs (:mod:`hybridflow.utils.profiler`, :mod:`hybridflow.trainer.ppo.step_profiler`): ``tool=torch``
(torch.profiler Chrome traces, per step or per phase call with ``discrete``), ``tool=torch_memory``
(CUDA memory snapshots) and ``tool=nsys`` (the workers under Nsight Systems: CUDA, with ``nsys`` on
this machine's PATH). Everything else is refused here, before Ray starts, one line per problem: the
tool not built here (``npu``), a tool the device or machine cannot run, values of the wrong type, ranks
a role does not have, a role enabled that the run does not build, and settings that would profile
nothing.
"""

from __future__ import annotations

import os
import shutil

from omegaconf import DictConfig, ListConfig, OmegaConf

from hybridflow.trainer.config.parallelism import device_type
from hybridflow.utils.profiler import DISCRETE_TOOLS, SHELL_SAFE, TOOLS, TORCH_CONTENTS, nsight_options

# profiler role -> (its config section, the fsdp_config whose pool runs it)
ROLE_SECTIONS = {
    "actor": ("actor_rollout_ref.actor", "actor_rollout_ref.actor.fsdp_config"),
    "rollout": ("actor_rollout_ref.rollout", "actor_rollout_ref.actor.fsdp_config"),
    "ref": ("actor_rollout_ref.ref", "actor_rollout_ref.ref.fsdp_config"),
    "critic": ("critic", "critic.model.fsdp_config"),
}
REFUSED_TOOLS = {
    "npu": "Ascend NPUs are not supported; use global_profiler.tool=torch",
}
MEMORY_KEYS = ("trace_alloc_max_entries", "stack_depth")
NSYS = "global_profiler.global_tool_config.nsys"
NSIGHT_OPTIONS = ("controller_nsight_options", "worker_nsight_options")


def _plain(value):
    return (
        OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tool_problems(key: str, tool) -> list[str]:
    if tool is None or tool in TOOLS:
        return []
    if tool in REFUSED_TOOLS:
        return [f"{key}={tool} is not supported: {REFUSED_TOOLS[tool]}"]
    return [f"{key}={tool!r} is not a profiler tool; use null, {' or '.join(TOOLS)} (docs/profiling.md)"]


def _torch_config(cfg: dict) -> dict:
    return (cfg.get("tool_config") or {}).get("torch") or {}


def _memory_problems(prefix: str, memory) -> list[str]:
    return [
        f"{prefix}.{key}={memory.get(key)!r} must be an integer > 0"
        for key in MEMORY_KEYS
        if not (_is_int(memory.get(key)) and memory.get(key) > 0)
    ]


def _nsys_machine_problems(config: DictConfig) -> list[str]:
    """``tool=nsys`` needs CUDA workers and Nsight Systems' CLI (and Ray's plugin starts each worker as
    ``nsys profile ... python``: a ``python`` on PATH)."""
    missing = []
    if device_type(config) != "cuda":
        missing.append(f"trainer.device={device_type(config)} is not cuda")
    if shutil.which("nsys") is None:
        missing.append("no nsys (Nsight Systems' CLI) on this machine's PATH")
    elif shutil.which("python") is None:
        missing.append("no `python` on PATH (Ray's nsight plugin runs `nsys profile ... python`)")
    if not missing:
        return []
    return [
        "global_profiler.tool=nsys runs the workers under Nsight Systems on CUDA, and here "
        f"{' and '.join(missing)}: install Nsight Systems and run on CUDA, or use global_profiler.tool=torch "
        "(its trace holds the CUDA kernels on CUDA)"
    ]


def _nsys_option_problems(profiler: dict, steps) -> list[str]:
    """verl's ``controller_nsight_options`` / ``worker_nsight_options``: option name -> string or null."""
    nsys = (profiler.get("global_tool_config") or {}).get("nsys") or {}
    problems = []
    for name in NSIGHT_OPTIONS:
        options = nsys.get(name)
        if options is None and name == "controller_nsight_options":
            continue  # not applied (the driver is not a Ray actor): nothing to check
        if not isinstance(options, dict):
            problems.append(f"{NSYS}.{name}={options!r} must be a mapping of nsys option -> value")
            continue
        problems += [
            f"{NSYS}.{name}.{key}={value!r} must be a string (nsys reads the value as text: quote it, "
            "e.g. 'true') or null (left out)"
            for key, value in options.items()
            if not (isinstance(value, str) or value is None)
        ]
    worker = nsys.get("worker_nsight_options")
    if problems or not isinstance(worker, dict):
        return problems
    if worker.get("capture-range") != "cudaProfilerApi":
        problems.append(
            f"{NSYS}.worker_nsight_options.capture-range={worker.get('capture-range')!r}: only "
            "cudaProfilerApi (the workers open and close the capture at the profiled steps with "
            "torch.cuda.profiler)"
        )
    save_path = os.path.abspath(os.path.expanduser(str(profiler.get("save_path"))))
    for key, value in nsight_options(worker, save_path, steps or [], False, False).items():
        if not (SHELL_SAFE.fullmatch(key) and SHELL_SAFE.fullmatch(value)):
            where = "global_profiler.save_path gives" if key == "o" and "o" not in worker else "is"
            problems.append(
                f"{NSYS}.worker_nsight_options.{key} {where} {value!r}, which Ray's nsight plugin puts "
                "unquoted into the shell command that starts a worker: use letters, digits and _@%+=:,./-"
            )
    return problems


def _global_problems(config: DictConfig, profiler: dict) -> list[str]:
    tool, steps = profiler.get("tool"), profiler.get("steps")
    problems = _tool_problems("global_profiler.tool", tool)
    if steps is not None and not (isinstance(steps, list) and all(_is_int(s) and s >= 1 for s in steps)):
        problems.append(
            f"global_profiler.steps={steps!r} must be null or a list of global steps >= 1, e.g. [1, 3]"
        )
        steps = None
    total = config.trainer.get("total_training_steps")
    if steps and total and max(steps) > int(total):
        problems.append(
            f"global_profiler.steps={steps} lists steps past trainer.total_training_steps={total}: they "
            "never run; list steps 1..total_training_steps"
        )
    if not isinstance(profiler.get("profile_continuous_steps"), bool):
        problems.append("global_profiler.profile_continuous_steps must be true or false")
    if not profiler.get("save_path") or not isinstance(profiler.get("save_path"), str):
        problems.append("global_profiler.save_path must be a directory path")
    memory = (profiler.get("global_tool_config") or {}).get("torch_memory") or {}
    problems += _memory_problems("global_profiler.global_tool_config.torch_memory", memory)
    nsys = (profiler.get("global_tool_config") or {}).get("nsys") or {}
    if not isinstance(nsys.get("discrete", False), bool):
        problems.append(f"{NSYS}.discrete must be true or false")
    if tool == "nsys":
        problems += _nsys_machine_problems(config) + _nsys_option_problems(profiler, steps)
    if steps and tool is None:
        problems.append(
            f"global_profiler.steps={steps} is set but global_profiler.tool is null, so nothing is profiled: "
            "set global_profiler.tool=torch (or torch_memory on CUDA)"
        )
    if tool == "torch_memory" and device_type(config) != "cuda":
        problems.append(
            f"global_profiler.tool=torch_memory records the CUDA allocator's history, and trainer.device="
            f"{config.trainer.device} has none: on the CPU use global_profiler.tool=torch with "
            "<role>.profiler.tool_config.torch.contents=[cpu, memory] (the profiler's memory events)"
        )
    return problems


def _in_use(config: DictConfig, role: str) -> str | None:
    """Why ``role`` is not built by this run (None: it is)."""
    from hybridflow.utils.roles import need_critic, need_reference

    if role == "critic" and not need_critic(config):
        return "the run has no critic (critic.enable / algorithm.adv_estimator)"
    if role == "ref" and not need_reference(config):
        return "the run has no reference policy (actor.use_kl_loss / algorithm.use_kl_in_reward)"
    return None


def _ranks_problems(config: DictConfig, key: str, ranks, fsdp_path: str) -> list[str]:
    from hybridflow.trainer.config.parallelism import role_world_size

    if not isinstance(ranks, list) or not all(_is_int(r) and r >= 0 for r in ranks):
        return [f"{key}.ranks={ranks!r} must be a list of ranks >= 0 ([]: rank 0)"]
    world = role_world_size(config, fsdp_path)
    outside = [r for r in ranks if r >= world]
    if outside:
        return [f"{key}.ranks={ranks}: {outside} not among the role's {world} worker ranks (0..{world - 1})"]
    return []


def _role_problems(config: DictConfig, role: str, profiler: dict, cfg: dict) -> list[str]:
    """One role's ``profiler`` section."""
    section, fsdp_path = ROLE_SECTIONS[role]
    key = f"{section}.profiler"
    tool, global_tool = cfg.get("tool"), profiler.get("tool")
    problems = [
        f"{key}.{flag} must be true or false"
        for flag in ("enable", "all_ranks")
        if not isinstance(cfg.get(flag), bool)
    ]
    if tool is not None and tool != global_tool:
        problems.append(
            f"{key}.tool={tool} differs from global_profiler.tool={global_tool}: one tool profiles a step; "
            "set the role's tool to null or to global_profiler.tool"
        )
    torch_cfg = _torch_config(cfg)
    contents, discrete = torch_cfg.get("contents"), torch_cfg.get("discrete")
    if not isinstance(contents, list) or any(c not in TORCH_CONTENTS for c in contents):
        problems.append(
            f"{key}.tool_config.torch.contents={contents!r}: use a list of {list(TORCH_CONTENTS)}"
        )
    elif "cuda" in contents and device_type(config) != "cuda":
        problems.append(
            f"{key}.tool_config.torch.contents lists cuda, and trainer.device={config.trainer.device} runs "
            "no CUDA activity: remove it"
        )
    if not isinstance(discrete, bool):
        problems.append(f"{key}.tool_config.torch.discrete must be true or false")
    nsys_discrete = ((cfg.get("tool_config") or {}).get("nsys") or {}).get("discrete", False)
    if not isinstance(nsys_discrete, bool):
        problems.append(f"{key}.tool_config.nsys.discrete must be true or false")
    problems += _memory_problems(
        f"{key}.tool_config.torch_memory", (cfg.get("tool_config") or {}).get("torch_memory") or {}
    )
    if cfg.get("enable") is not True:
        return problems
    problems += _ranks_problems(config, key, cfg.get("ranks"), fsdp_path)
    if not cfg.get("save_path") or not isinstance(cfg.get("save_path"), str):
        problems.append(f"{key}.save_path must be a directory path (default: global_profiler.save_path)")
    absent = _in_use(config, role)
    if absent:
        problems.append(f"{key}.enable=true, but {absent}: set it false")
    if profiler.get("steps") is None:
        problems.append(f"{key}.enable=true profiles nothing: global_profiler.steps is null; list the steps")
    for name, value in (("torch", discrete), ("nsys", nsys_discrete)):
        if value is True and global_tool is not None and global_tool != name:
            why = (
                f"reads tool_config.{global_tool}.discrete"
                if global_tool in DISCRETE_TOOLS
                else "dumps one snapshot per profiled step"
            )
            problems.append(
                f"{key}.tool_config.{name}.discrete=true is the {name} tool's, and global_profiler.tool="
                f"{global_tool} {why}: set it false"
            )
    if {"torch": discrete, "nsys": nsys_discrete}.get(global_tool) is True and profiler.get(
        "profile_continuous_steps"
    ) is True:
        unit, verb = ("trace", "writes") if global_tool == "torch" else ("capture range", "opens")
        problems.append(
            f"{key}.tool_config.{global_tool}.discrete=true {verb} a {unit} "
            f"per phase call, and global_profiler.profile_continuous_steps=true one {unit} per run of steps "
            "(verl refuses both too): set one of them false"
        )
    if global_tool == "nsys" and cfg.get("save_path") != profiler.get("save_path"):
        problems.append(
            f"{key}.save_path={cfg.get('save_path')!r}: with tool=nsys, Nsight Systems writes one report per "
            "worker process (all its roles), under global_profiler.save_path/nsys/ unless "
            f"{NSYS}.worker_nsight_options.o says otherwise; remove the role's save_path"
        )
    return problems


def profiler_problems(config: DictConfig) -> list[str]:
    """One line per profiler setting whose effect would not be delivered (empty: all honest)."""
    profiler = _plain(config.get("global_profiler")) or {}
    problems = _global_problems(config, profiler)
    enabled = {}
    for role, (section, _) in ROLE_SECTIONS.items():
        cfg = _plain(OmegaConf.select(config, f"{section}.profiler")) or {}
        problems += _role_problems(config, role, profiler, cfg)
        if cfg.get("enable") is True:
            enabled[role] = cfg
    tool = profiler.get("tool")
    if tool in TOOLS:  # one profiler per process: colocated roles must ask for the same recording
        settings = {role: (cfg.get("tool_config") or {}).get(tool) for role, cfg in enabled.items()}
        if len({repr(v) for v in settings.values()}) > 1:
            problems.append(
                f"the enabled roles' tool_config.{tool} differ ({settings}): roles sharing a process share "
                "its one profiler, which records one way; set them alike"
            )
    if profiler.get("tool") is not None and profiler.get("steps") and not enabled:
        problems.append(
            f"global_profiler.steps={profiler['steps']} with tool={profiler['tool']} profiles nothing: no "
            "role has profiler.enable=true; set e.g. actor_rollout_ref.actor.profiler.enable=true"
        )
    return problems


def _leaf(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


# rollout.profiler key -> the key its default follows (the actor's profiler, or global_profiler)
ROLLOUT_FOLLOWS = {
    "tool": "global_profiler.tool",
    "save_path": "global_profiler.save_path",
    "all_ranks": "actor_rollout_ref.actor.profiler.all_ranks",
    "ranks": "actor_rollout_ref.actor.profiler.ranks",
    "tool_config.torch.contents": "actor_rollout_ref.actor.profiler.tool_config.torch.contents",
    "tool_config.torch.discrete": "actor_rollout_ref.actor.profiler.tool_config.torch.discrete",
    "tool_config.nsys.discrete": "global_profiler.global_tool_config.nsys.discrete",
    "tool_config.torch_memory.trace_alloc_max_entries": (
        "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries"
    ),
    "tool_config.torch_memory.stack_depth": "global_profiler.global_tool_config.torch_memory.stack_depth",
}
NOT_PROFILED = (
    "fully_async_main does not profile the rollouter's replicas (the trainer's actor, ref and critic are "
    "profiled)"
)


def fully_async_profiler_problems(config: DictConfig) -> list[str]:
    """``fully_async_main``: the rollouter's replicas are not profiled, so ``rollout.profiler`` may only
    be off, each key at the value it follows."""
    key = "actor_rollout_ref.rollout.profiler"
    rollout = _plain(OmegaConf.select(config, key)) or {}
    problems = []
    if rollout.get("enable") is True:
        problems.append(
            f"{key}.enable=true: {NOT_PROFILED}; set it false (it follows actor.profiler.enable unless set)"
        )
    for leaf, follows in ROLLOUT_FOLLOWS.items():
        value = _leaf(rollout, leaf)
        if value != _plain(OmegaConf.select(config, follows)):
            problems.append(f"{key}.{leaf}={value}: {NOT_PROFILED}; remove it (default: {follows})")
    return problems
