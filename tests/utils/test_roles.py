"""Which roles a config needs (``hybridflow.utils.roles``), read off the default config and overrides."""

import pytest

from hybridflow.trainer.config import load_config
from hybridflow.utils.roles import need_critic, need_reference, roles_in_use


@pytest.mark.parametrize(
    "overrides, roles",
    [
        (["algorithm.adv_estimator=gae"], ["actor_rollout", "critic"]),  # GAE reads values
        (["algorithm.adv_estimator=grpo"], ["actor_rollout"]),
        (["algorithm.adv_estimator=grpo", "critic.enable=true"], ["actor_rollout", "critic"]),
        (["algorithm.adv_estimator=gae", "critic.enable=false"], ["actor_rollout"]),
        (
            ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true"],
            ["actor_rollout", "ref"],
        ),
        (["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=true"], ["actor_rollout", "ref"]),
        (["algorithm.adv_estimator=grpo", "reward_model.enable=true"], ["actor_rollout", "rm"]),
    ],
)
def test_roles_in_use(overrides, roles):
    base = ["actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false"]
    config = load_config([*base, *overrides])
    assert roles_in_use(config) == roles
    assert need_critic(config) is ("critic" in roles)
    assert need_reference(config) is ("ref" in roles)
