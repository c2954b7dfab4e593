"""verl's profiler keys (``global_profiler``, each role's ``profiler``): accepted where they work, refused
before Ray starts with what to do where they would not (hybridflow/trainer/config/profiler_honesty.py)."""

import os
import stat
import sys

import pytest

from hybridflow.trainer.config import ConfigError, load_config, validate_config
from hybridflow.trainer.config.profiler_honesty import fully_async_profiler_problems, profiler_problems

TORCH = ("global_profiler.tool=torch", "global_profiler.steps=[1,2]")
ACTOR = "actor_rollout_ref.actor.profiler"
NSIGHT = "global_profiler.global_tool_config.nsys"


ACCEPTED = [
    (),  # off: verl's defaults
    ("global_profiler.tool=torch",),  # a tool without steps: nothing asked, nothing profiled
    (*TORCH, f"{ACTOR}.enable=true"),
    (
        *TORCH,
        f"{ACTOR}.enable=true",
        f"{ACTOR}.all_ranks=true",
        f"{ACTOR}.tool_config.torch.contents=[cpu,memory]",
    ),
    (*TORCH, f"{ACTOR}.enable=true", f"{ACTOR}.ranks=[0,1]", "global_profiler.profile_continuous_steps=true"),
    (*TORCH, f"{ACTOR}.enable=true", f"{ACTOR}.tool_config.torch.discrete=true"),  # the rollout follows
    (*TORCH, "actor_rollout_ref.rollout.profiler.enable=true", f"{ACTOR}.enable=false"),
    (*TORCH, "critic.profiler.enable=true", "critic.enable=true", "global_profiler.save_path=/tmp/traces"),
    (*TORCH, "actor_rollout_ref.ref.profiler.enable=true", "actor_rollout_ref.actor.use_kl_loss=true"),
    (*TORCH, f"{ACTOR}.enable=true", f"+{NSIGHT}.worker_nsight_options.o=/tmp/r"),  # nsys options: free-form
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[" ".join(o) or "defaults" for o in ACCEPTED])
def test_profiler_settings_that_work_are_accepted(base_overrides, overrides):
    validate_config(load_config([*base_overrides, *overrides]))


REFUSED = [
    (
        ("global_profiler.tool=nsys",),
        "global_profiler.tool=nsys runs the workers under Nsight Systems on CUDA, and here "
        "trainer.device=cpu is not cuda",
    ),
    (("global_profiler.tool=npu",), "Ascend NPUs are not supported"),
    (("global_profiler.tool=perf",), "global_profiler.tool='perf' is not a profiler tool"),
    (
        ("global_profiler.tool=torch", "global_profiler.steps=[0]"),
        "must be null or a list of global steps >= 1",
    ),
    (
        ("global_profiler.tool=torch", "global_profiler.steps=3"),
        "global_profiler.steps=3 must be null or a list",
    ),
    (
        (*TORCH, f"{ACTOR}.enable=true", "trainer.total_training_steps=1"),
        "lists steps past trainer.total_training_steps=1",
    ),
    (
        ("global_profiler.steps=[1]", f"{ACTOR}.enable=true"),
        "global_profiler.tool is null, so nothing is profiled",
    ),
    (TORCH, "profiles nothing: no role has profiler.enable=true"),
    (
        ("global_profiler.tool=torch", f"{ACTOR}.enable=true"),
        "enable=true profiles nothing: global_profiler.steps",
    ),
    (
        ("global_profiler.tool=torch_memory", "global_profiler.steps=[1]", f"{ACTOR}.enable=true"),
        "tool=torch_memory records the CUDA allocator's history, and trainer.device=cpu has none",
    ),
    ((*TORCH, f"{ACTOR}.enable=true", f"{ACTOR}.tool_config.torch.contents=[cuda]"), "runs no CUDA activity"),
    (
        (*TORCH, f"{ACTOR}.enable=true", f"{ACTOR}.tool_config.torch.contents=[gpu]"),
        "contents=['gpu']: use a list of",
    ),
    (
        (*TORCH, f"{ACTOR}.enable=true", f"{ACTOR}.ranks=[2]"),
        "[2] not among the role's 2 worker ranks (0..1)",
    ),
    ((*TORCH, "critic.profiler.enable=true"), "critic.profiler.enable=true, but the run has no critic"),
    ((*TORCH, "actor_rollout_ref.ref.profiler.enable=true"), "but the run has no reference policy"),
    (
        (*TORCH, f"{ACTOR}.enable=true", f"{ACTOR}.tool=torch_memory"),
        "differs from global_profiler.tool=torch",
    ),
    (
        (*TORCH, f"{ACTOR}.enable=true", f"{ACTOR}.tool_config.torch.discrete=true", "critic.enable=true")
        + ("critic.profiler.enable=true",),
        "the enabled roles' tool_config.torch differ",
    ),
    (
        (*TORCH, f"{ACTOR}.enable=true", f"{ACTOR}.tool_config.torch.discrete=true")
        + ("global_profiler.profile_continuous_steps=true",),
        "discrete=true writes a trace per phase call, and global_profiler.profile_continuous_steps=true",
    ),
    (
        (
            *TORCH,
            f"{ACTOR}.enable=true",
            f"{ACTOR}.tool_config.torch.contents=[cpu,memory]",
            "critic.enable=true",
        )
        + ("critic.profiler.enable=true",),
        "share its one profiler, which records one way; set them alike",
    ),
    (
        ("global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=0",),
        "torch_memory.trace_alloc_max_entries=0 must be an integer > 0",
    ),
    (("trainer.profile_steps=[1,2]",), "use global_profiler.steps=[...] with global_profiler.tool=torch"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_profiler_settings_that_would_not_work_are_refused(base_overrides, overrides, message):
    with pytest.raises(ConfigError) as refused:
        validate_config(load_config([*base_overrides, *overrides]))
    assert message in str(refused.value)


# tool=nsys needs CUDA, which validate_config checks on this machine: these build the config with
# trainer.device=cuda and read the profiler's own checks, which need no GPU.
NSYS = ("trainer.device=cuda", "global_profiler.tool=nsys", "global_profiler.steps=[1,2]")
NSYS += (f"{ACTOR}.enable=true",)
NO_NSYS = "no nsys (Nsight Systems' CLI) on this machine's PATH"


@pytest.fixture()
def nsys_on_path(tmp_path, monkeypatch):
    """A fake ``nsys`` executable on PATH, ahead of this interpreter's directory (``python``)."""
    bin_dir = tmp_path / "nsys_bin"
    bin_dir.mkdir()
    nsys = bin_dir / "nsys"
    nsys.write_text("#!/bin/sh\nexit 0\n")
    nsys.chmod(nsys.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable)]))
    return bin_dir


def _nsys_problems(*overrides, config_name="ppo_trainer"):
    return profiler_problems(load_config([*NSYS, *overrides], config_name=config_name))


def test_nsys_without_the_binary_is_refused_naming_nsys(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nsys there
    problems = _nsys_problems()
    assert len(problems) == 1 and NO_NSYS in problems[0] and "tool=torch" in problems[0]
    assert "trainer.device" not in problems[0]


def test_nsys_on_the_cpu_is_refused_naming_the_device(nsys_on_path):
    problems = profiler_problems(load_config(NSYS[1:]))  # trainer.device=cpu
    assert len(problems) == 1 and "trainer.device=cpu is not cuda" in problems[0]
    assert NO_NSYS not in problems[0]


def test_nsys_on_cuda_with_nsys_on_path_is_accepted(nsys_on_path):
    assert _nsys_problems() == []
    assert _nsys_problems(f"{NSIGHT}.discrete=true") == []  # every role follows the global discrete
    assert _nsys_problems(f"+{NSIGHT}.worker_nsight_options.o=/tmp/reports/w_%p") == []
    assert _nsys_problems(f"{NSIGHT}.controller_nsight_options=null") == []  # not applied: not needed
    # fully_async_main: the rollout's nsys.discrete follows the global one, as its other keys follow theirs
    not_rollout = "actor_rollout_ref.rollout.profiler.enable=false"  # its replicas are not profiled there
    fully_async = load_config(
        [*NSYS, f"{NSIGHT}.discrete=true", not_rollout], config_name="fully_async_ppo_trainer"
    )
    assert fully_async_profiler_problems(fully_async) == []


def test_nsys_needs_python_on_path_for_rays_plugin(nsys_on_path, monkeypatch):
    monkeypatch.setenv("PATH", str(nsys_on_path))
    assert "no `python` on PATH" in " ".join(_nsys_problems())


NSYS_REFUSED = [
    (
        (f"{NSIGHT}.worker_nsight_options.cuda-memory-usage=true",),
        "worker_nsight_options.cuda-memory-usage=True must be a string",
    ),
    ((f"{NSIGHT}.worker_nsight_options=null",), "worker_nsight_options=None must be a mapping"),
    ((f"{NSIGHT}.worker_nsight_options.capture-range=none",), "capture-range='none': only cudaProfilerApi"),
    (("global_profiler.save_path=/tmp/my traces",), "global_profiler.save_path gives '/tmp/my traces/nsys/"),
    ((f"{NSIGHT}.discrete=yes",), "global_profiler.global_tool_config.nsys.discrete must be true or false"),
    (
        (f"{NSIGHT}.discrete=true", "global_profiler.profile_continuous_steps=true"),
        "tool_config.nsys.discrete=true opens a capture range per phase call, and global_profiler.profile_",
    ),
    ((f"{ACTOR}.tool_config.torch.discrete=true",), "torch.discrete=true is the torch tool's"),
    ((f"{ACTOR}.save_path=/tmp/actor",), "with tool=nsys, Nsight Systems writes one report per worker"),
]


@pytest.mark.parametrize(("overrides", "message"), NSYS_REFUSED, ids=[" ".join(o) for o, _ in NSYS_REFUSED])
def test_nsys_settings_that_would_not_work_are_refused(nsys_on_path, overrides, message):
    assert message in " | ".join(_nsys_problems(*overrides))


def test_nsys_discrete_under_another_tool_is_refused():
    problems = profiler_problems(load_config([*TORCH, f"{ACTOR}.enable=true", f"{NSIGHT}.discrete=true"]))
    assert any("nsys.discrete=true is the nsys tool's, and global_profiler.tool=torch" in p for p in problems)
