"""The driver's side of verl's profiler (hybridflow/trainer/ppo/step_profiler.py): the role profiles it
reads from verl's keys, and when it starts and stops the profile on the worker groups."""

import os
from types import SimpleNamespace

from hybridflow.trainer.config import load_config
from hybridflow.trainer.ppo.step_profiler import StepProfiler, role_profiles


class FakeGroup:
    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def start_profile(self, profile_step, profiles):
        self.calls.append((self.name, "start", profile_step, sorted(profiles)))

    def stop_profile(self, profile_step):
        self.calls.append((self.name, "stop", profile_step))


def _config(*overrides):
    config = load_config(list(overrides))
    from omegaconf import OmegaConf

    OmegaConf.resolve(config)
    return config


PROFILED = ("global_profiler.tool=torch", "actor_rollout_ref.actor.profiler.enable=true")


def _run(steps: str, continuous: bool, total: int, groups=None):
    calls: list = []
    actor = FakeGroup(calls, "actor_rollout")
    groups = groups or SimpleNamespace(actor_rollout=actor, ref=actor, critic=None)
    profiler = StepProfiler(
        _config(
            *PROFILED,
            f"global_profiler.steps={steps}",
            f"global_profiler.profile_continuous_steps={continuous}",
        )
    )
    for step in range(1, total + 1):
        profiler.begin(step, groups)
        profiler.end(step)
    profiler.close(total)
    return [(call[1], call[2]) for call in calls]


def test_role_profiles_read_verls_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    profiles = role_profiles(
        _config(
            *PROFILED,
            "global_profiler.steps=[2]",
            "actor_rollout_ref.actor.profiler.ranks=[1]",
            "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cpu,memory]",
            "critic.profiler.enable=true",
            "critic.profiler.all_ranks=true",
            "critic.profiler.save_path=critic_traces",
        )
    )
    assert sorted(profiles) == ["actor", "critic", "rollout"]  # the rollout follows the actor's switch
    assert profiles["actor"].ranks == (1,) and profiles["rollout"].ranks == (1,)
    assert profiles["actor"].contents == ("cpu", "memory") == profiles["rollout"].contents
    assert profiles["actor"].save_path == os.path.join(tmp_path, "outputs", "profile")  # the driver's cwd
    assert profiles["critic"].ranks is None and profiles["critic"].save_path == str(
        tmp_path / "critic_traces"
    )
    assert role_profiles(_config(*PROFILED)) == {}  # no steps: off
    assert role_profiles(_config("global_profiler.steps=[1]", PROFILED[1])) == {}  # no tool: off


def test_each_listed_step_is_its_own_profile():
    assert _run("[1,3]", False, 4) == [("start", 1), ("stop", 1), ("start", 3), ("stop", 3)]


def test_continuous_steps_share_a_profile_until_a_gap():
    assert _run("[1,2,4]", True, 4) == [("start", 1), ("stop", 2), ("start", 4), ("stop", 4)]


def test_a_continuous_profile_cut_short_by_the_end_of_training_is_closed():
    assert _run("[2,3]", True, 2) == [("start", 2), ("stop", 2)]


def test_only_the_groups_of_profiled_roles_are_called():
    calls: list = []
    actor, critic = FakeGroup(calls, "actor_rollout"), FakeGroup(calls, "critic")
    profiler = StepProfiler(
        _config(
            "global_profiler.tool=torch",
            "global_profiler.steps=[1]",
            "critic.profiler.enable=true",
        )
    )
    profiler.begin(1, SimpleNamespace(actor_rollout=actor, ref=actor, critic=critic))
    profiler.end(1)
    assert calls == [("critic", "start", 1, ["critic"]), ("critic", "stop", 1)]
    assert profiler.describe(total_steps=1)[0].startswith("profiling steps [1] with torch: critic (rank 0)")
