import numpy as np
import pytest
import torch

import hybridflow.algorithms as algos
from hybridflow.trainer.ppo import core_algos

# verl's two registry functions are core_algos' own: they read core_algos.ADV_ESTIMATOR_REGISTRY when
# called and word an unknown name as verl does; by default they reach the same registry.
VERL_WRAPPERS = {"register_adv_est", "get_adv_estimator_fn"}


def test_reexports_are_the_same_objects():
    for name in set(algos.__all__) - VERL_WRAPPERS:
        assert getattr(core_algos, name) is getattr(algos, name), name


def test_verl_registry_functions_reach_the_trainers_registry(monkeypatch):
    monkeypatch.setattr(algos.ADV_ESTIMATORS, "_entries", dict(algos.ADV_ESTIMATORS._entries))
    assert core_algos.get_adv_estimator_fn("grpo") is algos.get_adv_estimator_fn("grpo")

    @core_algos.register_adv_est("reexport_probe")
    def probe(token_level_rewards, response_mask, **kwargs):
        return token_level_rewards, token_level_rewards

    assert algos.get_adv_estimator_fn("reexport_probe") is probe


def test_verl_style_wrappers_match_registry():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.5]], dtype=torch.float64)
    mask = torch.ones_like(rewards)
    index = np.array(["a", "a", "b"])
    adv, ret = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    expected = algos.compute_advantage(
        "grpo", algos.AdvantageInputs(rewards, mask, index=index, norm_adv_by_std_in_grpo=False)
    )
    torch.testing.assert_close(adv, expected.advantages)
    torch.testing.assert_close(ret, expected.returns)
    adv, _ = core_algos.compute_rloo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(adv[:, -1], torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64))
    values = torch.full_like(rewards, 0.25)
    adv, ret = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    # row 0: A_1 = 1 - 0.25 = 0.75, A_0 = 0 + 0.25 - 0.25 + 0.75 = 0.75 -> returns 1
    torch.testing.assert_close(ret[0], torch.tensor([1.0, 1.0], dtype=torch.float64))


def test_compute_rewards_is_k1_penalty():
    scores = torch.tensor([[0.0, 1.0]])
    out = core_algos.compute_rewards(scores, torch.tensor([[0.2, 0.4]]), torch.tensor([[0.0, 0.1]]), 0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.1, 0.85]]))


def test_verl_registry_functions_follow_a_rebound_registry(monkeypatch):
    monkeypatch.setattr(core_algos, "ADV_ESTIMATOR_REGISTRY", {"double": lambda x: 2 * x})

    def inc(x):
        return x + 1

    core_algos.register_adv_est(core_algos.AdvantageEstimator.OPO)(inc)
    assert core_algos.get_adv_estimator_fn("double")(3) == 6
    assert core_algos.get_adv_estimator_fn("opo") is inc
    assert algos.get_adv_estimator_fn("opo") is not inc  # the trainer's registry is untouched
    unknown = "^Unknown advantage estimator simply: GAE. Registered: double, opo$"
    with pytest.raises(ValueError, match=unknown):
        core_algos.get_adv_estimator_fn("GAE")
