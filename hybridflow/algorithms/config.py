"""The ``algorithm`` config section as typed dataclasses (verl's ``verl.trainer.config.algorithm``).

Defined here, beside the maths that reads it (the advantage estimators accept ``config=AlgoConfig``),
and re-exported at ``hybridflow.trainer.config`` (verl's path), so lower layers never import the
trainer. Field names and defaults are verl's; ``ppo_trainer.yaml`` holds the values a run uses and
names these classes in ``_target_``, so ``omega_conf_to_dataclass(cfg.algorithm)`` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.utils.config import BaseConfig

__all__ = ["AlgoConfig", "FilterGroupsConfig", "KLControlConfig", "RolloutCorrectionConfig"]


@dataclass
class KLControlConfig(BaseConfig):
    """The in-reward KL coefficient (Ziegler et al. 2019, arXiv 1909.08593, sec. 2.2).

    ``type``: ``fixed`` keeps ``kl_coef``; ``adaptive`` moves it so the measured KL tracks
    ``target_kl``, with a proportional gain spread over ``horizon`` samples."""

    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig(BaseConfig):
    """DAPO dynamic sampling (arXiv 2503.14476): drop prompt groups whose ``metric`` is the same for
    every response (no learning signal), regenerating up to ``max_num_gen_batches`` (<= 0: no limit)."""

    enable: bool = False
    metric: str | None = None
    max_num_gen_batches: int = 0


@dataclass
class RolloutCorrectionConfig(BaseConfig):
    """verl's rollout-vs-trainer policy mismatch correction settings (``algorithm.rollout_correction``;
    applied by :mod:`hybridflow.algorithms.rollout_correction`)."""

    rollout_is: str | None = "sequence"
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"


@dataclass
class AlgoConfig(BaseConfig):
    """The ``algorithm`` section: advantage estimator and in-reward KL.

    ``gamma``/``lam``: discount and GAE lambda (arXiv 1506.02438); ``adv_estimator``: a registered
    estimator name; ``norm_adv_by_std_in_grpo``: False is Dr.GRPO (arXiv 2503.20783);
    ``use_kl_in_reward`` with ``kl_penalty`` (estimator name) and ``kl_ctrl``; ``use_pf_ppo`` with
    ``pf_ppo`` (verl's preference-feedback reweighting, not implemented here); ``filter_groups``
    (DAPO); ``rollout_correction`` (see :class:`RolloutCorrectionConfig`). Nested sections given as
    dicts are turned into their dataclasses.
    """

    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    use_pf_ppo: bool = False
    pf_ppo: dict[str, Any] = field(default_factory=dict)
    filter_groups: FilterGroupsConfig | None = None
    rollout_correction: RolloutCorrectionConfig | None = None

    def __post_init__(self) -> None:
        self._set_once("kl_ctrl", _as(KLControlConfig, self.kl_ctrl) or KLControlConfig())
        self._set_once("filter_groups", _as(FilterGroupsConfig, self.filter_groups))
        self._set_once("rollout_correction", _as(RolloutCorrectionConfig, self.rollout_correction))
        self._set_once("pf_ppo", dict(self.pf_ppo or {}))


def _as(cls: type, value: Any) -> Any:
    """``value`` as a ``cls`` instance: a mapping is unpacked into it, None and instances pass."""
    if value is None or isinstance(value, cls):
        return value
    return cls(**{k: v for k, v in dict(value).items()})
