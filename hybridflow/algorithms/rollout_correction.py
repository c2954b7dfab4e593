"""Rollout correction (verl's ``algorithm.rollout_correction``): importance sampling and rejection
sampling for samples the rollout drew from another policy than the one that trains on them.

Three policies: π_rollout drew the tokens (``rollout_log_probs``), π_old anchors the PPO ratio
(``old_log_probs``), π_θ is trained. The gap π_rollout ≠ π_old comes from a different engine or
precision, or — in asynchronous training — from stale weights.

- **IS weights** (``rollout_is``): ``token``: w_t = π_old(y_t)/π_rollout(y_t); ``sequence``:
  w = Π_t w_t broadcast to the sequence's tokens. Computed in log space, clamped to exp(±20), zeroed at
  padding, then truncated at ``rollout_is_threshold`` (TIS) and detached; with
  ``rollout_is_batch_normalize`` divided by their (token / sequence) mean so they average 1.
  The policy loss multiplies each token's loss by its weight.
- **Rejection** (``rollout_rs``, comma-separated, all must pass): with log ratio r = log π_old − log
  π_rollout, the per-token divergences k1 = −r, k2 = r²/2, k3 = eᣴ − 1 − r; ``token_kX`` keeps a
  token whose kX is within bounds, ``seq_sum_kX`` / ``seq_mean_kX`` / ``seq_max_kX`` keep a whole
  sequence whose sum / mean / max is. ``rollout_rs_threshold``: one value per option (or one for all);
  k1 options take ``"lower_upper"`` ratio bounds (a single value u means 1/u .. u) compared in log space,
  the others an upper bound. Rejected tokens leave ``response_mask``.
- **Modes**: decoupled (``bypass_mode=false``): π_old is the trainer's recompute and the weights
  correct π_rollout → π_old. Bypass (``bypass_mode=true``): π_old := π_rollout (no recompute); the
  ``bypass_mode`` policy loss compares π_θ with π_rollout itself — ``loss_type=ppo_clip`` is PPO's
  clipped ratio (the ratio is already the IS correction: no weights on top), ``reinforce`` is
  −E[sg(w)·log π_θ·A] with w = π_θ/π_rollout.

Metrics (``rollout_corr/*``): ``rollout_is_{mean,max,min,std,eff_sample_size,ratio_fraction_high,
ratio_fraction_low,seq_*}``, ``rollout_rs_{option}_*``, ``rollout_rs_masked_fraction``,
``rollout_rs_seq_masked_fraction``, and the off-policy gap: ``kl`` (E[log π_rollout − log π_old]),
``k3_kl``, ``training_ppl``, ``rollout_ppl``, ``log_ppl_diff``, ``chi2_token``, ``chi2_seq``, ...
Shapes: every tensor (B, T_r).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridflow.algorithms.loss_agg import agg_loss
from hybridflow.algorithms.policy_loss import (
    PolicyLossConfig,
    PolicyLossInputs,
    register_policy_loss,
    vanilla_policy_loss,
)

SAFETY_BOUND = 20.0  # log-space clamp before exponentiating: weights stay within [2e-9, 5e8]
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclass(frozen=True)
class RolloutCorrection:
    """``algorithm.rollout_correction`` (verl's keys)."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    @classmethod
    def from_config(cls, section) -> RolloutCorrection | None:
        """From a config section; None when the section is absent or turns nothing on."""
        if not section:
            return None
        get = section.get
        made = cls(
            rollout_is=get("rollout_is"),
            rollout_is_threshold=float(get("rollout_is_threshold", 2.0) or 2.0),
            rollout_is_batch_normalize=bool(get("rollout_is_batch_normalize", False)),
            rollout_rs=get("rollout_rs"),
            rollout_rs_threshold=get("rollout_rs_threshold"),
            bypass_mode=bool(get("bypass_mode", False)),
            loss_type=str(get("loss_type", "ppo_clip") or "ppo_clip"),
        )
        return made if made.enabled else None

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode

    def problems(self) -> list[str]:
        """What in the section is not a valid setting (one line each)."""
        found = []
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            found.append(f"rollout_is={self.rollout_is!r}: use null, token or sequence")
        if self.rollout_is_threshold <= 0:
            found.append(f"rollout_is_threshold must be positive, got {self.rollout_is_threshold}")
        if self.loss_type not in LOSS_TYPES:
            found.append(f"loss_type={self.loss_type!r}: use one of {list(LOSS_TYPES)}")
        if self.rollout_rs is not None:
            try:
                rs_thresholds(rs_options(self.rollout_rs), self.rollout_rs_threshold)
            except (ValueError, TypeError) as error:
                found.append(str(error))
        return found


# ---------------------------------------------------------------------------------------------- helpers
def _masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp_min(1e-8)
    return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1e-8)


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    return (values * mask.to(values.dtype)).sum(dim)


def rs_options(spec: str) -> list[str]:
    """The comma-separated rejection options, validated, without repeats (in order)."""
    options = list(dict.fromkeys(opt.strip() for opt in str(spec).split(",") if opt.strip()))
    if not options:
        raise ValueError("rollout_rs must name at least one option")
    unknown = [opt for opt in options if opt not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"rollout_rs: unknown option(s) {unknown}; known: {list(RS_OPTIONS)}")
    return options


def rs_thresholds(options: list[str], spec) -> dict[str, tuple[float | None, float]]:
    """Option -> (lower, upper) bounds. k1 options: ratio bounds ``"lower_upper"`` (one value u means
    1/u .. u); the others: an upper bound on the divergence."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be set when rollout_rs is")
    parts = (
        [str(spec)]
        if isinstance(spec, int | float)
        else [p.strip() for p in str(spec).split(",") if p.strip()]
    )
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold: give one threshold or one per option ({len(options)})")
    parts = parts * len(options) if len(parts) == 1 else parts
    bounds: dict[str, tuple[float | None, float]] = {}
    for option, part in zip(options, parts, strict=True):
        if option.endswith("k1"):
            lower_text, _, upper_text = part.partition("_") if "_" in part else ("", "", part)
            upper = float(upper_text)
            lower = float(lower_text) if lower_text else 1.0 / upper
            if lower <= 0 or upper <= 0:
                raise ValueError(f"rollout_rs_threshold for {option}: bounds must be positive, got {part}")
            bounds[option] = (lower, upper)
        else:
            if "_" in part:
                raise ValueError(f"rollout_rs_threshold for {option}: one upper bound, not {part!r}")
            upper = float(part)
            if upper <= 0:
                raise ValueError(f"rollout_rs_threshold for {option}: must be positive, got {part}")
            bounds[option] = (None, upper)
    return bounds


# ---------------------------------------------------------------------------------------------- IS
def is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    threshold: float,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights (B, T_r) from ``log_ratio`` = log π_train − log π_rollout, and their
    metrics (before truncation, as verl reports them)."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r}: use token or sequence")
    if level == "token":
        for_metrics = log_ratio
        weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        for_metrics = _masked_sum(log_ratio, response_mask, -1).unsqueeze(-1)
        weights = torch.exp(for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    weights = weights * response_mask
    metrics = _is_metrics(weights, for_metrics, response_mask, level, threshold)
    weights = weights.clamp(max=threshold).detach()
    if batch_normalize:
        if level == "token":
            mean = _masked_mean(weights, response_mask)
        else:
            per_sequence = _masked_mean(weights, response_mask, dim=-1)
            has_tokens = (response_mask.sum(-1) > 0).to(weights.dtype)
            mean = (per_sequence * has_tokens).sum() / has_tokens.sum().clamp_min(1e-8)
        factor = float(mean) if float(mean) > 1e-8 else 1.0
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def _is_metrics(weights, for_metrics, mask, level: str, threshold: float) -> dict[str, float]:
    lower = 1.0 / threshold
    metrics: dict[str, float] = {"rollout_is_mean": float(_masked_mean(weights, mask))}
    if level == "sequence":
        metrics["rollout_is_max"] = math.exp(min(float(for_metrics.max()), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(float(for_metrics.min()))
        metrics["rollout_is_ratio_fraction_high"] = float((for_metrics > math.log(threshold)).float().mean())
        metrics["rollout_is_ratio_fraction_low"] = float((for_metrics < math.log(lower)).float().mean())
    else:
        valid = mask.bool()
        metrics["rollout_is_ratio_fraction_high"] = float(_masked_mean((weights > threshold).float(), mask))
        metrics["rollout_is_ratio_fraction_low"] = float(_masked_mean((weights < lower).float(), mask))
        metrics["rollout_is_max"] = float(weights.masked_fill(~valid, float("-inf")).max())
        metrics["rollout_is_min"] = float(weights.masked_fill(~valid, float("inf")).min())
    bounded = weights.clamp(min=lower, max=threshold)
    mean = _masked_mean(bounded, mask)
    if mask.sum() > 1:
        metrics["rollout_is_std"] = float(
            torch.sqrt((_masked_mean(bounded**2, mask) - mean**2).clamp_min(0.0))
        )
    else:
        metrics["rollout_is_std"] = 0.0
    metrics["rollout_is_eff_sample_size"] = float(1.0 / _masked_mean((bounded / (mean + 1e-8)) ** 2, mask))
    per_sequence = _masked_mean(weights, mask, dim=-1)
    metrics["rollout_is_seq_mean"] = float(per_sequence.mean())
    metrics["rollout_is_seq_std"] = float(per_sequence.std()) if per_sequence.numel() > 1 else 0.0
    metrics["rollout_is_seq_max"] = float(per_sequence.max())
    metrics["rollout_is_seq_min"] = float(per_sequence.min())
    metrics["rollout_is_seq_max_deviation"] = float((per_sequence - 1.0).abs().max())
    metrics["rollout_is_seq_fraction_high"] = float((per_sequence > threshold).float().mean())
    metrics["rollout_is_seq_fraction_low"] = float((per_sequence < lower).float().mean())
    return metrics


# ---------------------------------------------------------------------------------------------- RS
def rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, spec: str, threshold_spec
) -> tuple[torch.Tensor, dict[str, float]]:
    """``response_mask`` with the tokens / sequences outside the bounds of every option set to 0."""
    options = rs_options(spec)
    bounds = rs_thresholds(options, threshold_spec)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergence = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    valid = response_mask.bool()
    keep_all = torch.ones_like(log_ratio)
    metrics: dict[str, float] = {}
    for option in options:
        lower, upper = bounds[option]
        scope, kind = option.rsplit("_", 1)
        if scope == "token":
            stat = divergence[kind]
        elif scope == "seq_sum":
            stat = _masked_sum(divergence[kind], response_mask, -1).unsqueeze(-1).expand_as(log_ratio)
        elif scope == "seq_mean":
            stat = _masked_mean(divergence[kind], response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
        else:  # seq_max
            worst = divergence[kind].masked_fill(~valid, float("-inf")).max(dim=-1).values
            worst = torch.where(torch.isinf(worst), torch.zeros_like(worst), worst)
            stat = worst.unsqueeze(-1).expand_as(log_ratio)
        if kind == "k1":  # bounds on the ratio, compared in log space
            keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            keep = stat <= upper
        keep = keep.to(log_ratio.dtype)
        keep_all = keep_all * keep
        metrics[f"rollout_rs_{option}_mean"] = float(_masked_mean(stat, response_mask))
        metrics[f"rollout_rs_{option}_masked_fraction"] = float(_masked_mean(1 - keep, response_mask))
        rejected_sequences = ((keep < 0.5) & valid).any(dim=-1)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = float(rejected_sequences.float().mean())
    metrics["rollout_rs_masked_fraction"] = float(_masked_mean(1 - keep_all, response_mask))
    metrics["rollout_rs_seq_masked_fraction"] = float((((keep_all < 0.5) & valid).any(dim=-1)).float().mean())
    return (response_mask * keep_all).to(response_mask.dtype), metrics


# ---------------------------------------------------------------------------------------------- gap
def offpolicy_metrics(
    train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far π_rollout is from π_train on the sampled tokens (verl's diagnostics)."""
    log_ratio = train_log_prob - rollout_log_prob
    train_mean = _masked_mean(train_log_prob, mask, dim=-1)
    rollout_mean = _masked_mean(rollout_log_prob, mask, dim=-1)
    log_ppl_diff = rollout_mean - train_mean
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_sum = _masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-train_mean).mean()),
        "training_log_ppl": float((-train_mean).mean()),
        "kl": float(_masked_mean(rollout_log_prob - train_log_prob, mask)),
        "k3_kl": float(_masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
        "rollout_ppl": float(torch.exp(-rollout_mean).mean()),
        "rollout_log_ppl": float((-rollout_mean).mean()),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
        "log_ppl_diff_max": float(log_ppl_diff.max()),
        "log_ppl_diff_min": float(log_ppl_diff.min()),
        "ppl_ratio": float(torch.exp(log_ppl_diff).mean()),
        "chi2_token": float(_masked_mean(torch.exp(safe) ** 2, mask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_sum).mean() - 1.0),
    }


def correct(
    train_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrection,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights or None, response mask after rejection, ``rollout_corr/*`` metrics)."""
    if not response_mask.any():
        raise ValueError("rollout correction: the batch has no response token")
    log_ratio = (train_log_prob - rollout_log_prob).float()
    metrics: dict[str, float] = {}
    weights = None
    if config.rollout_is is not None:
        weights, found = is_weights(
            log_ratio,
            response_mask,
            config.rollout_is,
            config.rollout_is_threshold,
            config.rollout_is_batch_normalize,
        )
        metrics.update(found)
    mask = response_mask
    if config.rollout_rs is not None:
        mask, found = rejection_mask(log_ratio, response_mask, config.rollout_rs, config.rollout_rs_threshold)
        metrics.update(found)
    metrics.update(offpolicy_metrics(train_log_prob.float(), rollout_log_prob.float(), response_mask))
    return weights, mask, {f"rollout_corr/{key}": value for key, value in metrics.items()}


# ---------------------------------------------------------------------------------------------- bypass
def _bypass_config(config) -> RolloutCorrection:
    """The rollout correction the bypass loss runs with (``actor.policy_loss.rollout_correction``)."""
    section = config.policy_loss.get("rollout_correction")
    made = RolloutCorrection.from_config(section)
    if made is None:
        raise ValueError(
            "policy loss bypass_mode needs actor.policy_loss.rollout_correction (set "
            "algorithm.rollout_correction.bypass_mode=true: the trainer fills it in)"
        )
    return made


@register_policy_loss("bypass_mode")
def bypass_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's ``bypass_mode`` loss: ``old_log_prob`` here *is* π_rollout. IS weights and rejection are
    computed against the current π_θ (detached): ``ppo_clip`` runs PPO's clipped ratio π_θ/π_rollout
    with the rejection mask and no extra weights (the ratio is the correction); ``reinforce`` is
    −sg(w)·log π_θ·A with w the truncated π_θ/π_rollout. Returns (loss, metrics)."""
    loss_config = PolicyLossConfig.from_config(config, loss_agg_mode)
    correction = _bypass_config(loss_config)
    with torch.no_grad():
        weights, mask, metrics = correct(log_prob.detach(), old_log_prob, response_mask, correction)
    if correction.loss_type == "reinforce":
        losses = -advantages * log_prob * (weights if weights is not None else 1.0)
        pg_loss = agg_loss(losses, mask, loss_config.loss_agg_mode, *loss_config.agg_info())
        ppo_kl = _masked_mean(old_log_prob - log_prob.detach(), mask)
        out = {
            "actor/ppo_kl": ppo_kl,
            "actor/pg_clipfrac": torch.zeros(()),
            "actor/pg_clipfrac_lower": torch.zeros(()),
        }
    else:
        pg_loss, out = vanilla_policy_loss(
            PolicyLossInputs(old_log_prob, log_prob, advantages, mask), loss_config
        )
    return pg_loss, {**out, **{key: torch.tensor(value) for key, value in metrics.items()}}
