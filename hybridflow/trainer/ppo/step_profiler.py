"""The driver's side of verl's profiler: start and stop it on the worker groups around chosen steps.

``global_profiler.steps`` lists the global steps to profile with ``global_profiler.tool``; each role
whose ``profiler.enable`` is true (``actor_rollout_ref.actor``, ``.rollout``, ``.ref``, ``critic``)
records them on its selected ranks (:mod:`hybridflow.utils.profiler` writes the files). As verl's
trainer, the profile of a step opens before its generation and closes after its updates (validation and
checkpointing are outside it); with ``profile_continuous_steps`` a run of consecutive listed steps is one
profile, opened at its first step and closed after its last (or when training stops inside it).
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from hybridflow.utils.profiler import RoleProfile, selected_ranks

# the profiler role -> its config section
ROLE_SECTIONS = {
    "actor": "actor_rollout_ref.actor",
    "rollout": "actor_rollout_ref.rollout",
    "ref": "actor_rollout_ref.ref",
    "critic": "critic",
}


def role_profiles(config: DictConfig) -> dict[str, RoleProfile]:
    """The enabled roles' profiles (empty when ``global_profiler`` profiles nothing). A relative
    ``save_path`` is taken from the driver's working directory."""
    from omegaconf import OmegaConf

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
        profiles[role] = RoleProfile(
            tool=str(tool),
            save_path=os.path.abspath(os.path.expanduser(str(cfg.save_path))),
            ranks=selected_ranks(bool(cfg.all_ranks), list(cfg.ranks or [])),
            contents=tuple(torch_cfg.contents or ()),
            discrete=bool(torch_cfg.discrete) and tool == "torch",
            trace_alloc_max_entries=int(memory_cfg.trace_alloc_max_entries),
            stack_depth=int(memory_cfg.stack_depth),
        )
    return profiles


class StepProfiler:
    """Opens and closes the profile of the chosen steps on the worker groups of the profiled roles."""

    def __init__(self, config: DictConfig) -> None:
        profiler = config.get("global_profiler") or {}
        self.profiles = role_profiles(config)
        self.steps = {int(s) for s in (profiler.get("steps") or [])} if self.profiles else set()
        self.continuous = bool(profiler.get("profile_continuous_steps", False))
        self.open_since: int | None = None
        self._groups: list = []

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


def _ranks(ranks: tuple[int, ...] | None) -> str:
    if ranks is None:
        return "all ranks"
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"
