"""``trainer.placement*`` keys: what each value builds, and every mistake named before Ray starts."""

import pytest

from hybridflow.placement.spec import Placement, placement_from_config
from hybridflow.trainer.config import ConfigError, load_config, validate_config

PPO = ["critic.enable=true", "actor_rollout_ref.actor.use_kl_loss=true"]  # actor, ref, critic


@pytest.fixture()
def base(tiny_model_dir, arithmetic_data):
    train, test = arithmetic_data
    return [
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.n=2",
    ]


def _pools(spec: str, mapping: str | None = None, *extra: str) -> list[str]:
    out = ["trainer.placement=pools", f"trainer.resource_pool_spec={spec}"]
    return out + ([f"trainer.role_pool_mapping={mapping}"] if mapping else []) + list(extra)


def _problems(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(overrides))
    return str(err.value)


def test_colocated_default_is_one_pool_of_every_worker_holding_every_role(base):
    config = load_config([*base, *PPO, "trainer.n_gpus_per_node=2"])
    validate_config(config)
    assert placement_from_config(config) == Placement(
        {"global_pool": (2,)}, {"actor_rollout": "global_pool", "ref": "global_pool", "critic": "global_pool"}
    )


def test_pools_map_roles_and_unmapped_roles_follow_the_actor(base):
    config = load_config([*base, *PPO, *_pools("{actor:[1],aux:[1]}", "{actor_rollout:actor,critic:aux}")])
    validate_config(config)
    placement = placement_from_config(config)
    assert placement.mapping == {"actor_rollout": "actor", "ref": "actor", "critic": "aux"}
    assert placement.world_size("critic") == 1 and placement.total_workers == 2
    assert placement.describe() == "actor_rollout+ref on actor [1]; critic on aux [1]"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.placement=spread"], "trainer.placement='spread': use one of colocated, pools, auto"),
        (
            ["trainer.resource_pool_spec={a:[2]}"],
            "resource_pool_spec / role_pool_mapping are only read with trainer.placement=pools",
        ),
        (["trainer.placement=pools"], "trainer.placement=pools needs trainer.resource_pool_spec"),
        (_pools("{a:[0]}"), "trainer.resource_pool_spec.a=[0]: use a list of worker processes per node"),
        (_pools("{a:[1,1]}"), "trainer.resource_pool_spec.a lists 2 nodes but trainer.nnodes=1"),
        (
            _pools("{a:[2],b:[1]}", "{actor_rollout:a,critic:b}"),
            "puts 3 worker processes on node 0 but trainer.n_gpus_per_node=2",
        ),
        (
            _pools("{a:[1],b:[1]}", "{critic:b}"),
            "role_pool_mapping.actor_rollout: say which pool the actor runs on",
        ),
        (_pools("{a:[2]}", "{actor_rollout:a,judge:a}"), "role_pool_mapping.judge: unknown role"),
        (_pools("{a:[2]}", "{actor_rollout:b}"), "role_pool_mapping.actor_rollout='b' is not a pool"),
        (_pools("{a:[1],b:[1]}", "{actor_rollout:a}"), "resource_pool_spec.b: no role runs on this pool"),
        (["trainer.placement=auto"], "trainer.placement=auto needs trainer.placement_profile"),
        (["trainer.placement_profile=/x.json"], "placement_profile is only read with trainer.placement=auto"),
        (["trainer.concurrent_phases=sometimes"], "trainer.concurrent_phases='sometimes': use true or false"),
    ],
)
def test_placement_mistakes_are_named(base, overrides, message):
    assert message in _problems([*base, *PPO, *overrides])


def test_a_mapped_role_the_run_does_not_have_is_an_error(base):
    # GRPO without a KL term: no critic, no reference
    message = _problems([*base, *_pools("{a:[1],b:[1]}", "{actor_rollout:a,critic:b}")])
    assert (
        "role_pool_mapping.critic: this run has no critic (roles in use: actor_rollout); remove it" in message
    )


def test_batch_sizes_must_split_over_each_pool(base):
    # 5 prompts x 2 responses = 10 rows: they split over the actor pool's 1 worker, not the aux pool's 4
    overrides = [
        *base,
        *PPO,
        "trainer.n_gpus_per_node=5",
        "data.train_batch_size=5",
        "actor_rollout_ref.actor.ppo_mini_batch_size=5",
    ]
    message = _problems([*overrides, *_pools("{actor:[1],aux:[4]}", "{actor_rollout:actor,critic:aux}")])
    assert "data.train_batch_size x rollout.n=10 is not divisible by pool 'aux' worker processes=4" in message
    assert (
        "critic.ppo_mini_batch_size x rollout.n=10 is not divisible by pool 'aux' worker processes=4"
        in message
    )
    assert "pool 'actor'" not in message  # 10 rows split over the actor's 1 worker


def test_fsdp_size_is_checked_against_the_role_pool(base):
    overrides = [*base, *PPO, *_pools("{actor:[1],aux:[1]}", "{actor_rollout:actor,critic:aux}")]
    validate_config(load_config([*overrides, "critic.model.fsdp_config.fsdp_size=1"]))  # the critic's pool: 1
    message = _problems([*overrides, "critic.model.fsdp_config.fsdp_size=2"])
    assert (
        "critic.model.fsdp_config.fsdp_size=2 is not supported: every model is sharded over all 1" in message
    )
