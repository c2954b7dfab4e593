"""Advantage estimators, registered under verl's names and called with verl's keyword signature.

A registered estimator is ``fn(token_level_rewards, response_mask, index=None, epsilon=1e-6,
norm_adv_by_std_in_grpo=True, config=None, **kwargs) -> (advantages, returns)`` (verl's
``register_adv_est`` contract; GAE takes ``values, gamma, lam``, ReMax ``reward_baselines``), so a
verl user's ``@register_adv_est("my_est")`` function runs unchanged. :func:`compute_advantage` is the
only dispatcher: it offers every field of :class:`AdvantageInputs` (plus ``config``, the
``algorithm`` section) by keyword and passes each estimator the ones its signature takes — all of
them when it has ``**kwargs``. No estimator is special-cased.

Each estimator turns per-token rewards (B, T_r) into per-token advantages and returns (B, T_r).
"Outcome" estimators sum each row's rewards into one score and compare it with the other responses to
the same prompt (the same ``index`` / uid): the group statistics are computed with ``index_add_`` over
dense group ids, never a Python loop over the batch. Semantics follow verl's ``core_algos.py``.

============================  ======================================================  =========
name                          advantage of response i (score s_i, group G, n = |G|)   needs
============================  ======================================================  =========
gae                           GAE(gamma, lambda) over the critic's values, whitened   values
grpo                          (s_i - mean_G) / (std_G + eps); Dr.GRPO drops the std   index
rloo                          (n s_i - sum_G) / (n - 1) = s_i - mean of the others    index
reinforce_plus_plus           discounted return-to-go, whitened over the batch        --
reinforce_plus_plus_baseline  s_i - mean_G on every token, whitened over the batch    index
remax                         return-to-go - greedy-rollout reward b_i                baselines
opo                           s_i - sum_G(len_j s_j) / sum_G(len_j), length-weighted  index
gpg                           (B / #nonzero scores) * (s_i - mean_G)                  index
grpo_passk                    group best: (s_max - s_2nd) / (std_G + eps); others 0   index
============================  ======================================================  =========

``grpo_vectorized`` and ``rloo_vectorized`` (verl's names for its vectorised versions) are aliases:
every estimator here is vectorised. Singleton groups behave as in verl: mean 0 and std 1, so their
advantage is the raw score (rloo: the raw score too); ``grpo_passk`` rejects them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from hybridflow.utils.registry import Registry
from hybridflow.utils.torch_functional import masked_whiten


@dataclass
class AdvantageInputs:
    """Everything an estimator may read. Shapes: B rows, T_r response tokens."""

    token_level_rewards: torch.Tensor  # (B, T_r) reward per token (outcome reward on the last token)
    response_mask: torch.Tensor  # (B, T_r) 1 on response tokens that are trained
    index: np.ndarray | None = None  # (B,) group id (uid); equal ids = responses to one prompt
    values: torch.Tensor | None = None  # (B, T_r) critic values V(s_t), for gae
    reward_baselines: torch.Tensor | None = None  # (B,) greedy-rollout reward, for remax
    gamma: float = 1.0  # discount factor
    lam: float = 1.0  # GAE lambda (arXiv 1506.02438)
    norm_adv_by_std_in_grpo: bool = True  # False = Dr.GRPO (arXiv 2503.20783)
    epsilon: float = 1e-6  # added to the group std before dividing
    config: Any = None  # the ``algorithm`` config section, handed to estimators as ``config``


class AdvantageOutput(NamedTuple):
    """Advantages and critic/return targets, both (B, T_r)."""

    advantages: torch.Tensor
    returns: torch.Tensor


# verl's keyword signature: fn(token_level_rewards, response_mask, ..., config=None, **kwargs)
AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def register_adv_est(name, *aliases) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an estimator under ``name`` (a str, or an Enum whose ``.value`` is used)."""
    return ADV_ESTIMATORS.register(name, *aliases)


def get_adv_estimator_fn(name) -> AdvantageFn:
    """The estimator registered under ``name`` (str or Enum); raises listing the registered names."""
    return ADV_ESTIMATORS.get(name)


def compute_advantage(name, inputs: AdvantageInputs) -> AdvantageOutput:
    """Run the named estimator with the keyword arguments its signature takes."""
    fn = get_adv_estimator_fn(name)
    offered = {
        "token_level_rewards": inputs.token_level_rewards,
        "response_mask": inputs.response_mask,
        "index": inputs.index,
        "values": inputs.values,
        "reward_baselines": inputs.reward_baselines,
        "gamma": inputs.gamma,
        "lam": inputs.lam,
        "epsilon": inputs.epsilon,
        "norm_adv_by_std_in_grpo": inputs.norm_adv_by_std_in_grpo,
        "config": inputs.config if inputs.config is not None else _algo_view(inputs),
    }
    names, takes_any = _signature(fn)
    kwargs = {k: v for k, v in offered.items() if k in names or (takes_any and v is not None)}
    advantages, returns = fn(**kwargs)
    return AdvantageOutput(advantages, returns)


@functools.cache
def _signature(fn: Callable) -> tuple[frozenset[str], bool]:
    params = inspect.signature(fn).parameters.values()
    names = frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
    return names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _algo_view(inputs: AdvantageInputs) -> dict:
    """A minimal ``algorithm`` section for estimators that read ``config`` when none was given."""
    return {
        "gamma": inputs.gamma,
        "lam": inputs.lam,
        "norm_adv_by_std_in_grpo": inputs.norm_adv_by_std_in_grpo,
    }


def _config_value(config, key: str, default):
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


# ----------------------------------------------------------------------------- helpers


class _Groups(NamedTuple):
    ids: torch.Tensor  # (B,) int64 dense group id in [0, G)
    count: torch.Tensor  # (G,) group sizes, in the scores' dtype
    labels: np.ndarray  # (G,) the original uid of each dense id, for error messages


def _groups(index, estimator: str, like: torch.Tensor) -> _Groups:
    if index is None:
        raise ValueError(f"advantage estimator {estimator!r} needs the group index (uid), which is None")
    index = np.asarray(index)
    if index.shape != (like.shape[0],):
        raise ValueError(f"index has shape {index.shape}, expected ({like.shape[0]},) for {estimator!r}")
    labels, inverse = np.unique(index, return_inverse=True)
    ids = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=like.device)
    count = torch.bincount(ids, minlength=len(labels)).to(like.dtype)
    return _Groups(ids, count, labels)


def _group_sum(x: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """Per-group sums of a (B,) tensor -> (G,)."""
    return torch.zeros_like(groups.count).index_add_(0, groups.ids, x)


def _group_mean_std(scores: torch.Tensor, groups: _Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and unbiased std (B,), with mean 0 / std 1 for singleton groups (verl)."""
    mean = _group_sum(scores, groups) / groups.count
    sq_dev = _group_sum((scores - mean[groups.ids]) ** 2, groups)
    std = torch.sqrt(sq_dev / (groups.count - 1).clamp(min=1))
    single = groups.count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[groups.ids], std[groups.ids]


def _outcome(per_sample: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Broadcast a (B,) advantage over the valid tokens; returns = advantages, as in verl."""
    advantages = per_sample.unsqueeze(-1) * response_mask
    return advantages, advantages


def _scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    return token_level_rewards.sum(dim=-1)


# ----------------------------------------------------------------------------- estimators


@register_adv_est("gae")
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2015, arXiv 1506.02438, eq. 16).

    ``delta_t = r_t + gamma V_{t+1} - V_t``; ``A_t = delta_t + gamma lambda A_{t+1}``; returns ``A + V``;
    advantages are then whitened over valid tokens. Masked positions (padding, or tool-observation tokens
    inside a multi-turn response) are skipped: the recursion carries ``V`` and ``A`` across them.
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs the critic's values, which are None")
    rewards, mask = token_level_rewards, response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        m = mask[:, t]
        next_value = m * values[:, t] + (1 - m) * next_value
        next_adv = m * adv_t + (1 - m) * next_adv
        reversed_adv.append(next_adv)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, mask), returns


@register_adv_est("grpo", "grpo_vectorized")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-normalised outcome advantage (Shao et al. 2024, arXiv 2402.03300, sec. 4.1.2).

    With ``norm_adv_by_std_in_grpo=False`` this is Dr.GRPO's ``s_i - mean_G`` (arXiv 2503.20783).
    """
    scores = _scores(token_level_rewards)
    mean, std = _group_mean_std(scores, _groups(index, "grpo", scores))
    centred = scores - mean
    if norm_adv_by_std_in_grpo:
        centred = centred / (std + epsilon)
    return _outcome(centred, response_mask)


@register_adv_est("rloo", "rloo_vectorized")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv 2402.14740): ``s_i - mean_{j != i} s_j``."""
    scores = _scores(token_level_rewards)
    groups = _groups(index, "rloo", scores)
    n = groups.count[groups.ids]
    loo = (n * scores - _group_sum(scores, groups)[groups.ids]) / (n - 1).clamp(min=1)
    return _outcome(torch.where(n > 1, loo, scores), response_mask)


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config=None,
    gamma: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted return-to-go, whitened over the batch.

    ``G_t = r_t + gamma G_{t+1}``, restarted after each masked position; ``gamma`` from the keyword or
    ``config.gamma`` (verl). Returns are the raw ``G_t``.
    """
    gamma = float(gamma if gamma is not None else _config_value(config, "gamma", 1.0))
    rewards, mask = token_level_rewards, response_mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline (arXiv 2501.03262): ``s_i - mean_G``, then batch-whitened."""
    scores = _scores(token_level_rewards)
    mean, _ = _group_mean_std(scores, _groups(index, "reinforce_plus_plus_baseline", scores))
    per_token = (scores - mean).unsqueeze(-1) * response_mask
    advantages = masked_whiten(per_token, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("remax")
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv 2310.10505): return-to-go minus the greedy response's reward ``b_i``."""
    if reward_baselines is None:
        raise ValueError("advantage estimator 'remax' needs reward_baselines (the greedy rollout's scores)")
    mask = response_mask
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1) * mask
    return advantages, returns


@register_adv_est("opo")
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv 2505.23585).

    Baseline = length-weighted group mean ``sum_G(|o_j| s_j) / sum_G |o_j|``; 0 for singleton groups.
    """
    scores = _scores(token_level_rewards)
    groups = _groups(index, "opo", scores)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    weight = _group_sum(lengths, groups)
    baseline = _group_sum(lengths * scores, groups) / torch.where(weight == 0, 1, weight)
    baseline = torch.where(groups.count == 1, torch.zeros_like(baseline), baseline)
    return _outcome(scores - baseline[groups.ids], response_mask)


@register_adv_est("gpg")
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient (Chu et al. 2025, arXiv 2504.02546): ``alpha (s_i - mean_G) / f_norm``.

    ``alpha = B / #{i : s_i != 0}`` rescales for the responses that carry no signal (as in verl).
    """
    scores = _scores(token_level_rewards)
    mean, _ = _group_mean_std(scores, _groups(index, "gpg", scores))
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    return _outcome(alpha * (scores - mean) / f_norm, response_mask)


@register_adv_est("grpo_passk")
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (Chen et al. 2025, arXiv 2503.19595): only each group's best response learns.

    The best gets ``s_max - s_2nd`` (divided by ``std_G + eps`` when ``norm_adv_by_std_in_grpo``, read
    from ``config`` as verl does, else from the keyword); all others get 0. Every group needs at least
    two responses.
    """
    norm_by_std = bool(_config_value(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo))
    scores = _scores(token_level_rewards)
    groups = _groups(index, "grpo_passk", scores)
    if bool((groups.count < 2).any()):
        bad = groups.labels[(groups.count < 2).cpu().numpy()]
        raise ValueError(f"grpo_passk needs >= 2 responses per group; singleton groups: {bad.tolist()}")
    # Order rows by (group, score descending): the first two rows of each group are its top two.
    by_score = torch.sort(scores, descending=True, stable=True).indices
    order = by_score[torch.sort(groups.ids[by_score], stable=True).indices]
    starts = torch.cumsum(groups.count.long(), dim=0) - groups.count.long()
    best, second = order[starts], order[starts + 1]
    gap = scores[best] - scores[second]
    if norm_by_std:
        _, std = _group_mean_std(scores, groups)
        gap = gap / (std[best] + epsilon)
    per_sample = torch.zeros_like(scores).index_put_((best,), gap)
    return _outcome(per_sample, response_mask)
