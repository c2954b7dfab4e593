"""The driver's side of verl's profiler (hybridflow/trainer/ppo/step_profiler.py): the role profiles it
reads from verl's keys, and when it starts and stops the profile on the worker groups."""

import os
from types import SimpleNamespace

import pytest
from ray.runtime_env import RuntimeEnv

from hybridflow.single_controller.ray.base import worker_runtime_env
from hybridflow.trainer.config import load_config
from hybridflow.trainer.ppo.step_profiler import StepProfiler, nsight_runtime_env, role_profiles


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


NSYS = (
    "trainer.device=cuda",
    "global_profiler.tool=nsys",
    "actor_rollout_ref.actor.profiler.enable=true",
)


def _nsight(*overrides, save_path="/tmp/prof", roles=("actor_rollout",)):
    env = nsight_runtime_env(_config(*NSYS, f"global_profiler.save_path={save_path}", *overrides), roles)
    return None if env is None else env["nsight"]


def test_nsys_starts_the_profiled_pools_workers_under_nsight(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    options = _nsight("global_profiler.steps=[1,3]", save_path="traces")
    # verl's worker_nsight_options, the report absolute under save_path (Ray keeps an absolute o)
    assert options == {
        "trace": "cuda,nvtx,cublas,ucx",
        "cuda-memory-usage": "true",
        "cuda-graph-trace": "graph",
        "capture-range": "cudaProfilerApi",
        "capture-range-end": "repeat-shutdown:2",  # one capture range per listed step
        "kill": "none",
        "o": str(tmp_path / "traces" / "nsys" / "worker_process_%p"),
    }
    env = worker_runtime_env({"RANK": "0"}, {"nsight": options})  # what each worker's actor options get
    accepted = RuntimeEnv(**env)
    assert accepted.nsight() == options and accepted.env_vars() == {"RANK": "0"}
    with pytest.raises(ValueError, match="as env, not env_vars"):
        worker_runtime_env({}, {"env_vars": {"A": "1"}})


def test_nsys_capture_ranges_per_worker_process():
    steps = "global_profiler.steps=[1,2,4]"
    assert _nsight(steps)["capture-range-end"] == "repeat-shutdown:3"
    continuous = _nsight(steps, "global_profiler.profile_continuous_steps=true")
    assert continuous["capture-range-end"] == "repeat-shutdown:2"  # [1,2] and [4]
    discrete = _nsight(steps, "global_profiler.global_tool_config.nsys.discrete=true")
    assert discrete["capture-range-end"] == "repeat-shutdown:18"  # verl's len(steps) * 6 phases
    mine = "global_profiler.global_tool_config.nsys.worker_nsight_options.capture-range-end=stop"
    assert _nsight(steps, mine)["capture-range-end"] == "stop"
    own_report = "+global_profiler.global_tool_config.nsys.worker_nsight_options.o=/r/w_%p"
    assert _nsight(steps, own_report)["o"] == "/r/w_%p"


def test_only_pools_of_profiled_roles_run_under_nsight():
    steps = "global_profiler.steps=[1]"
    assert _nsight(steps, roles=("critic", "rm")) is None  # only the actor is profiled
    assert _nsight(steps, roles=("rm", "actor_rollout")) is not None
    assert _nsight(steps, "critic.profiler.enable=true", "critic.enable=true", roles=("critic",)) is not None
    torch = _config(*NSYS, steps, "global_profiler.tool=torch")
    assert nsight_runtime_env(torch, ("actor_rollout",)) is None


def test_build_worker_groups_passes_the_nsight_runtime_env(monkeypatch):
    from hybridflow.trainer.ppo import workers_setup

    made = {}

    class RecordingGroup:
        def __init__(self, pool, cls, name_prefix, num_threads, env, runtime_env=None):
            made[pool.name_prefix.rsplit("_", 1)[0]] = runtime_env

        def spawn(self, roles):
            return {role: self for role in roles}

    monkeypatch.setattr(workers_setup, "RayWorkerGroup", RecordingGroup)
    config = _config(
        *NSYS,
        "global_profiler.steps=[1]",
        "critic.enable=true",
        "trainer.placement=pools",
        "trainer.resource_pool_spec={actor:[1],aux:[1]}",
        "trainer.role_pool_mapping={actor_rollout:actor,critic:aux}",
    )
    workers_setup.build_worker_groups(config, use_critic=True, use_reference=False)
    assert made["aux"] is None  # the critic is not profiled
    assert made["actor"]["nsight"]["capture-range-end"] == "repeat-shutdown:1"


def test_nsys_start_up_lines_say_the_driver_is_not_profiled():
    lines = StepProfiler(_config(*NSYS, "global_profiler.steps=[1]")).describe(total_steps=1)
    assert lines[0].startswith("profiling steps [1] with nsys: actor (rank 0), rollout (rank 0)")
    assert "worker_process_%p*.nsys-rep" in lines[1]
    assert "the driver (this process) is not profiled" in lines[2]
    assert "`nsys profile --trace=cuda,nvtx,cublas,ucx --cuda-memory-usage=true" in lines[2]
