"""The driver's side of verl's profiler: start and stop it on the worker groups around chosen steps.

``global_profiler.steps`` lists the global steps to profile with ``global_profiler.tool``; each role
whose ``profiler.enable`` is true (``actor_rollout_ref.actor``, ``.rollout``, ``.ref``, ``critic``)
records them on its selected ranks (:mod:`hybridflow.utils.profiler` writes the files). As verl's
trainer, the profile of a step opens before its generation and closes after its updates (validation and
checkpointing are outside it); with ``profile_continuous_steps`` a run of consecutive listed steps is one
profile, opened at its first step and closed after its last (or when training stops inside it).

``tool=nsys``: :func:`nsight_runtime_env` is the runtime_env entry that starts the worker processes of a
pool holding a profiled role under ``nsys profile`` (verl's ``worker_nsight_options``, completed by
:func:`hybridflow.utils.profiler.nsight_options`). The driver is this process, not a Ray actor, so
``controller_nsight_options`` cannot start it: :meth:`StepProfiler.describe` says so at start-up.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace

from omegaconf import DictConfig, OmegaConf

from hybridflow.utils.profiler import RoleProfile, nsight_options, nsight_reports, selected_ranks

# the profiler role -> its config section
ROLE_SECTIONS = {
    "actor": "actor_rollout_ref.actor",
    "rollout": "actor_rollout_ref.rollout",
    "ref": "actor_rollout_ref.ref",
    "critic": "critic",
}
# a placement role (workers_setup) -> the profiler roles its worker holds
PLACED_ROLES = {"actor_rollout": ("actor", "rollout"), "ref": ("ref",), "critic": ("critic",), "rm": ()}
NSYS = "global_profiler.global_tool_config.nsys"


def role_profiles(config: DictConfig) -> dict[str, RoleProfile]:
    """The enabled roles' profiles (empty when ``global_profiler`` profiles nothing). A relative
    ``save_path`` is taken from the driver's working directory."""
    tool = OmegaConf.select(config, "global_profiler.tool")
    if tool is None or not OmegaConf.select(config, "global_profiler.steps"):
        return {}
    profiles = {}
    for role, section in ROLE_SECTIONS.items():
        cfg = OmegaConf.select(config, f"{section}.profiler")
        if cfg is None or not cfg.get("enable"):
            continue
        torch_cfg = cfg.tool_config.torch
        memory_cfg = cfg.tool_config.torch_memory
        discrete = {
            "torch": torch_cfg.discrete,
            "nsys": OmegaConf.select(cfg, "tool_config.nsys.discrete", default=False),
        }.get(str(tool), False)
        profiles[role] = RoleProfile(
            tool=str(tool),
            save_path=_absolute(cfg.save_path),
            ranks=selected_ranks(bool(cfg.all_ranks), list(cfg.ranks or [])),
            contents=tuple(torch_cfg.contents or ()),
            discrete=bool(discrete),
            trace_alloc_max_entries=int(memory_cfg.trace_alloc_max_entries),
            stack_depth=int(memory_cfg.stack_depth),
        )
    if tool == "nsys" and profiles:  # where each profiled process's reports go (printed by the workers)
        report = nsight_reports(worker_nsight_options(config, any(p.discrete for p in profiles.values())))
        profiles = {role: replace(p, report=report) for role, p in profiles.items()}
    return profiles


def _absolute(path) -> str:
    return os.path.abspath(os.path.expanduser(str(path)))


def worker_nsight_options(config: DictConfig, discrete: bool) -> dict[str, str]:
    """verl's ``worker_nsight_options``, completed (the report under ``global_profiler.save_path/nsys``,
    ``capture-range-end`` from the listed steps): what ``nsys profile`` gets for each profiled worker."""
    profiler = config.global_profiler
    return nsight_options(
        OmegaConf.to_container(OmegaConf.select(config, f"{NSYS}.worker_nsight_options") or {}, resolve=True),
        _absolute(profiler.save_path),
        list(profiler.steps or []),
        bool(profiler.get("profile_continuous_steps", False)),
        discrete,
    )


def nsight_runtime_env(config: DictConfig, placed_roles) -> dict | None:
    """The runtime_env entry that starts a pool's worker processes under ``nsys profile`` (Ray's nsight
    plugin, ``{"nsight": options}`` as verl passes it), or None: unless ``global_profiler.tool=nsys``
    profiles a role among ``placed_roles`` (the pool's placement roles: ``actor_rollout``, ``ref``, ...)."""
    if OmegaConf.select(config, "global_profiler.tool") != "nsys":
        return None
    profiles = role_profiles(config)
    if not any(role in profiles for placed in placed_roles for role in PLACED_ROLES.get(placed, ())):
        return None
    return {"nsight": worker_nsight_options(config, any(p.discrete for p in profiles.values()))}


def nsys_command(options: dict) -> str:
    """``nsys profile`` with ``options`` as Ray's nsight plugin spells them (for the driver's line)."""
    words = [f"--{k}={v}" if len(k) > 1 else f"-{k} {v}" for k, v in options.items() if v is not None]
    return " ".join(["nsys", "profile", *words])


class StepProfiler:
    """Opens and closes the profile of the chosen steps on the worker groups of the profiled roles."""

    def __init__(self, config: DictConfig) -> None:
        profiler = config.get("global_profiler") or {}
        self.profiles = role_profiles(config)
        self.steps = {int(s) for s in (profiler.get("steps") or [])} if self.profiles else set()
        self.continuous = bool(profiler.get("profile_continuous_steps", False))
        self.open_since: int | None = None
        self._groups: list = []
        self.controller_nsight = None  # tool=nsys: verl's controller_nsight_options (not applied: the note)
        if self.profiles and profiler.get("tool") == "nsys":
            options = OmegaConf.select(config, f"{NSYS}.controller_nsight_options")
            self.controller_nsight = OmegaConf.to_container(options, resolve=True) if options else {}

    def describe(self, total_steps: int) -> list[str]:
        """Start-up lines: what is profiled where, and listed steps the run will not reach."""
        if not self.steps:
            return []
        roles = ", ".join(f"{role} ({_ranks(p.ranks)})" for role, p in self.profiles.items())
        first = next(iter(self.profiles.values()))
        lines = [f"profiling steps {sorted(self.steps)} with {first.tool}: {roles} -> {first.save_path}"]
        beyond = sorted(s for s in self.steps if s > total_steps)
        if beyond:
            lines.append(
                f"global_profiler.steps {beyond} are past this run's {total_steps} steps: not profiled"
            )
        if self.controller_nsight is not None:
            lines += _nsys_lines(first.report, self.controller_nsight)
        return lines

    def begin(self, step: int, groups) -> None:
        """Before step ``step``: open a profile if the step is listed and none is open."""
        if step not in self.steps or self.open_since is not None:
            return
        self._groups = _profiled_groups(groups, self.profiles)
        for group in self._groups:
            group.start_profile(profile_step=step, profiles=self.profiles)
        self.open_since = step

    def end(self, step: int) -> None:
        """After step ``step``: close the open profile unless the next step continues it."""
        if self.open_since is None or (self.continuous and step + 1 in self.steps):
            return
        self.close(step)

    def close(self, step: int) -> None:
        """Close the open profile, if any, as ending at ``step`` (the end of training)."""
        if self.open_since is None:
            return
        for group in self._groups:
            group.stop_profile(profile_step=step)
        self.open_since, self._groups = None, []


def _profiled_groups(groups, profiles: dict[str, RoleProfile]) -> list:
    """The distinct worker groups holding a profiled role (``groups``: the trainer's WorkerGroups)."""
    wanted = [
        (groups.actor_rollout, bool({"actor", "rollout"} & profiles.keys())),
        (groups.ref, "ref" in profiles),
        (groups.critic, "critic" in profiles),
    ]
    found: dict[int, object] = {}
    for group, profiled in wanted:
        if group is not None and profiled:
            found.setdefault(id(group), group)
    return list(found.values())


def _nsys_lines(report: str, controller: dict) -> list[str]:
    lines = [
        f"nsys: the profiled roles' worker processes run under `nsys profile`; reports: {report}",
        "nsys: the driver (this process) is not profiled: it is not a Ray actor, so "
        f"{NSYS}.controller_nsight_options cannot start it under Nsight Systems; to profile it, run this "
        f"command under `{nsys_command(controller)}`",
    ]
    python = shutil.which("python")
    here = os.path.dirname(os.path.abspath(sys.executable))
    if python and os.path.dirname(os.path.abspath(python)) != here:
        lines.append(
            "nsys: Ray's nsight plugin starts each worker as `nsys profile ... python`, and `python` on "
            f"PATH is {python}, not this driver's {sys.executable}: activate its environment if workers fail"
        )
    return lines


def _ranks(ranks: tuple[int, ...] | None) -> str:
    if ranks is None:
        return "all ranks"
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"
