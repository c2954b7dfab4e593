"""verl's profiler keys (``global_profiler``, each role's ``profiler``): accepted where they work, refused
before Ray starts with what to do where they would not (hybridflow/trainer/config/profiler_honesty.py)."""

import pytest

from hybridflow.trainer.config import ConfigError, load_config, validate_config

TORCH = ("global_profiler.tool=torch", "global_profiler.steps=[1,2]")
ACTOR = "actor_rollout_ref.actor.profiler"


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
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[" ".join(o) or "defaults" for o in ACCEPTED])
def test_profiler_settings_that_work_are_accepted(base_overrides, overrides):
    validate_config(load_config([*base_overrides, *overrides]))


REFUSED = [
    (
        ("global_profiler.tool=nsys",),
        "global_profiler.tool=nsys is not supported: Nsight Systems is not built",
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
