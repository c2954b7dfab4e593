"""AlgoConfig and friends: verl's typed ``algorithm`` section, built from our YAML and accepted by the
advantage estimators as ``config=``."""

import numpy as np
import pytest
import torch

from hybridflow.algorithms.config import (
    AlgoConfig,
    FilterGroupsConfig,
    KLControlConfig,
    RolloutCorrectionConfig,
)
from hybridflow.trainer.config import load_config
from hybridflow.trainer.ppo.core_algos import compute_grpo_passk_outcome_advantage
from hybridflow.utils.config import omega_conf_to_dataclass


def test_defaults_are_verls_and_nested_dicts_become_dataclasses():
    cfg = AlgoConfig(
        gamma=0.9, kl_ctrl={"type": "adaptive", "target_kl": 0.05}, filter_groups={"enable": True}
    )
    assert (cfg.gamma, cfg.lam, cfg.adv_estimator, cfg.kl_penalty) == (0.9, 1.0, "gae", "kl")
    assert (
        cfg.norm_adv_by_std_in_grpo and not cfg.use_kl_in_reward and not cfg.use_pf_ppo and cfg.pf_ppo == {}
    )
    assert cfg.kl_ctrl == KLControlConfig(type="adaptive", target_kl=0.05)
    assert isinstance(cfg.filter_groups, FilterGroupsConfig) and cfg.filter_groups.enable
    assert AlgoConfig().kl_ctrl == KLControlConfig() and AlgoConfig().rollout_correction is None
    carried = AlgoConfig(rollout_correction={"rollout_is": "token", "rollout_is_threshold": 3.0})
    assert isinstance(carried.rollout_correction, RolloutCorrectionConfig)
    assert (
        carried.rollout_correction.rollout_is_threshold == 3.0
        and carried.rollout_correction.bypass_mode is False
    )


def test_built_from_our_composed_yaml_through_its_target():
    config = load_config(["algorithm.gamma=0.5", "algorithm.kl_ctrl.kl_coef=0.2"])
    algo = omega_conf_to_dataclass(config.algorithm)
    assert isinstance(algo, AlgoConfig) and algo.gamma == 0.5 and algo.adv_estimator == "grpo"
    assert isinstance(algo.kl_ctrl, KLControlConfig) and algo.kl_ctrl.kl_coef == 0.2
    assert isinstance(algo.filter_groups, FilterGroupsConfig) and algo.filter_groups.metric == "acc"


def test_verls_import_path_gives_the_same_classes():
    import hybridflow.trainer.config as trainer_config

    assert trainer_config.AlgoConfig is AlgoConfig and trainer_config.KLControlConfig is KLControlConfig
    with pytest.raises(AttributeError):
        trainer_config.NoSuchConfig  # noqa: B018


def test_estimator_reads_the_algo_config():
    # one group, scores [1, 0]: the best response's gap is 1 - 0 = 1; the unbiased group std is
    # sqrt(((1 - 0.5)^2 + (0 - 0.5)^2) / 1) = sqrt(0.5), so normalised it is 1 / sqrt(0.5) = 1.41421.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones_like(rewards)
    index = np.array(["p", "p"])
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, config=AlgoConfig())
    torch.testing.assert_close(adv[0], torch.full((2,), 1 / (0.5**0.5 + 1e-6), dtype=torch.float64))
    adv, _ = compute_grpo_passk_outcome_advantage(
        rewards, mask, index, config=AlgoConfig(norm_adv_by_std_in_grpo=False)
    )
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64))
