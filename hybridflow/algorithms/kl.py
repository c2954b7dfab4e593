"""KL estimators, KL-coefficient controllers and the KL-in-reward penalty.

Per-token estimators of KL(pi || pi_ref) from sampled log-probs, with
``log_r = log pi(a|s) - log pi_ref(a|s)`` (J. Schulman, "Approximating KL divergence", 2020):

- ``k1`` / ``kl``          log_r                        (unbiased, high variance, can be negative)
- ``abs``                  |log_r|
- ``k2`` / ``mse``         0.5 * log_r^2                (its gradient is the true KL gradient)
- ``k3`` / ``low_var_kl``  exp(-log_r) + log_r - 1      (unbiased, >= 0; clamped to [-10, 10])

A trailing ``+`` (e.g. ``k3+``) keeps the estimator's value but takes the k2 gradient (straight-through),
as in verl. The controllers follow Ziegler et al. 2019 (arXiv 1909.08593).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hybridflow.utils.registry import Registry
from hybridflow.utils.torch_functional import masked_mean

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    # Clamps as in verl: the log-ratio before exp (overflow), the estimate itself (outlier tokens).
    neg_log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    kld = torch.exp(neg_log_ratio) - neg_log_ratio - 1
    return torch.clamp(kld, min=-10.0, max=10.0)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate, shapes (B, T), (B, T) -> (B, T), with the named estimator."""
    if kl_penalty.endswith("+"):
        value = KL_ESTIMATORS.get(kl_penalty[:-1])(log_prob, ref_log_prob)
        grad_path = kl_k2(log_prob, ref_log_prob)
        return grad_path - grad_path.detach() + value.detach()
    return KL_ESTIMATORS.get(kl_penalty)(log_prob, ref_log_prob)


_penalty = kl_penalty  # apply_kl_penalty_to_rewards' verl-named argument shadows the function


class FixedKLController:
    """Constant KL coefficient ``beta``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""


class AdaptiveKLController:
    """Proportional controller driving the observed KL toward ``target_kl`` (Ziegler et al. 2019, eq. 2).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


def get_kl_controller(
    kl_ctrl_type, kl_coef: float | None = None, target_kl: float = 0.1, horizon: float = 10000
) -> KLController:
    """Build the ``"fixed"`` or ``"adaptive"`` controller. Also takes verl's form: one
    ``algorithm.kl_ctrl`` section (``type``, ``kl_coef``, ``target_kl``, ``horizon``)."""
    if not isinstance(kl_ctrl_type, str):
        section = kl_ctrl_type
        kl_ctrl_type, kl_coef = section.type, section.kl_coef
        target_kl, horizon = getattr(section, "target_kl", target_kl), getattr(section, "horizon", horizon)
    kl_coef = float(kl_coef)
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown kl_ctrl type {kl_ctrl_type!r}. Registered: adaptive, fixed")


def apply_kl_penalty_to_rewards(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, float]:
    """KL-in-reward (InstructGPT-style): ``r_t = score_t - beta * KL_t`` on every response token.

    Shapes: all tensors (B, T_r). Returns ``(token_level_rewards (B, T_r), current_kl)`` where
    ``current_kl`` is the batch mean of each sequence's masked-mean KL -- the value to feed to
    ``controller.update(current_kl, n_steps=B)``.
    """
    kld = _penalty(old_log_probs, ref_log_prob, kl_penalty) * response_mask
    token_level_rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean()
    return token_level_rewards, float(current_kl.item())
