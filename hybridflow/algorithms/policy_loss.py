"""Policy-gradient losses, registered under verl's names and called with verl's signature.

Every registered loss is ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
config, rollout_is_weights=None) -> (pg_loss, metrics)`` (verl's ``register_policy_loss`` contract),
so a verl user's ``@register_policy_loss("my_loss")`` function runs unchanged; a function that
returns verl's older 4-tuple ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`` is accepted too.
``config`` is a :class:`PolicyLossConfig`: the actor section's loss settings with verl's attribute
names (``config.clip_ratio``, ``config.policy_loss.clip_cov_ratio``, ``config.global_batch_info``,
``config.get(...)``), falling back to the raw actor section for any other key. The built-in losses
are written against typed inputs (:class:`PolicyLossInputs`) and wrapped into that signature.

Notation (per token, B x T_r): ``r = pi_theta / pi_old = exp(log_prob - old_log_prob)`` with the log-ratio
clamped to [-20, 20] before ``exp`` (as verl), advantage ``A``, clip range ``[1 - eps_low, 1 + eps_high]``.

- ``vanilla``   PPO clip ``max(-A r, -A clip(r))`` (arXiv 1707.06347) with DAPO's asymmetric clip-higher
                (arXiv 2503.14476) and dual-clip ``min(., -A c)`` for A < 0 (arXiv 1912.09729).
- ``gspo``      sequence-level ratio ``s_i = exp(mean_t log r_it)`` clipped like PPO (arXiv 2507.18071).
- ``gpg``       plain policy gradient ``-A log pi`` (arXiv 2504.02546).
- ``cispo``     ``-sg(clip(r)) A log pi``: clip the IS weight, never the gradient (MiniMax-M1, 2506.13585).
- ``sapo``      soft gate ``-A (4 / tau) sigmoid(tau (r - 1))``, tau by sign of A (arXiv 2511.20347).
- ``clip_cov``  PPO, plus stop-gradient on a few random tokens of high cov(A, log pi) (arXiv 2505.22617).
- ``kl_cov``    PPO without clip, plus ``|log r|`` penalty on the top-cov(A, log pi) tokens (same paper).

Every loss reports ``actor/pg_clipfrac``, ``actor/ppo_kl`` (masked mean of ``log pi_old - log pi``) and
``actor/pg_clipfrac_lower`` as detached 0-dim tensors (0 where the notion does not apply). The scalar
loss is aggregated with :func:`hybridflow.algorithms.loss_agg.agg_loss` and ``config.global_batch_info``,
i.e. it is this micro-batch's share of the mini-batch objective.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from hybridflow.algorithms.loss_agg import GlobalBatchInfo, agg_loss
from hybridflow.utils.registry import Registry
from hybridflow.utils.torch_functional import masked_mean

LOG_RATIO_CLAMP = 20.0  # |log r| bound before exp, as verl: exp(20) ~ 5e8 cannot overflow fp16/bf16 losses


class PolicyLossInputs(NamedTuple):
    """Per-token tensors, all (B, T_r)."""

    old_log_prob: torch.Tensor  # log pi_old(a_t|s_t), behaviour policy (no grad)
    log_prob: torch.Tensor  # log pi_theta(a_t|s_t), current policy (requires grad)
    advantages: torch.Tensor  # A_t
    response_mask: torch.Tensor  # 1 on trained response tokens
    rollout_is_weights: torch.Tensor | None = None  # rollout-vs-trainer IS correction, multiplies the loss


# Per-loss settings that verl keeps under ``actor.policy_loss``.
POLICY_LOSS_SECTION_KEYS = (
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "tau_pos",
    "tau_neg",
)


class _Section(dict):
    """A read-only mapping that also answers attribute access (``config.policy_loss.tau_pos``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _read(source, key: str, default=None):
    """``source.key`` for DictConfig, dict or plain objects; ``default`` when absent or None."""
    if source is None:
        return default
    value = source.get(key, default) if hasattr(source, "get") else getattr(source, key, default)
    return default if value is None else value


@dataclass
class PolicyLossConfig:
    """The actor's policy-loss settings; names and defaults are verl's (``actor_rollout_ref.actor``)."""

    loss_mode: str = "vanilla"  # registered policy-loss name, used by compute_policy_loss
    clip_ratio: float = 0.2  # PPO epsilon; the default for both bounds below
    clip_ratio_low: float | None = None  # lower epsilon (None: clip_ratio); vanilla/gspo/cispo/clip_cov
    clip_ratio_high: float | None = None  # upper epsilon (None: clip_ratio); DAPO clip-higher uses 0.28
    clip_ratio_c: float = 3.0  # dual-clip bound c > 1 on the loss of negative-advantage tokens
    loss_agg_mode: str = "token-mean"  # see hybridflow.algorithms.loss_agg (gspo/sapo: seq-mean-token-mean)
    loss_scale_factor: float | None = None  # divisor for seq-mean-token-sum-norm (None: T_r)
    # gspo and cispo have no keys of their own: they use clip_ratio_low/high (GSPO paper: 3e-4 / 4e-4).
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of valid tokens whose gradient is detached
    clip_cov_lb: float = 1.0  # clip_cov: covariance lower bound for candidate tokens
    clip_cov_ub: float = 5.0  # clip_cov: covariance upper bound for candidate tokens
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of valid tokens (top covariance) given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of the |log r| penalty
    tau_pos: float = 1.0  # sapo: gate temperature for A > 0
    tau_neg: float = 1.05  # sapo: gate temperature for A <= 0
    # How this micro-batch relates to its mini-batch (set by the actor per mini-batch; see loss_agg).
    dp_size: int = 1
    batch_num_tokens: float | None = None
    global_batch_size: float | None = None
    source: Any = dataclasses.field(default=None, repr=False, compare=False)  # the raw actor section

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {self.clip_ratio_c}")
        for name in ("clip_cov_ratio", "kl_cov_ratio", "tau_pos", "tau_neg"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, config=None, loss_agg_mode: str | None = None) -> PolicyLossConfig:
        """From a PolicyLossConfig, or from a verl-style actor section (DictConfig, dict, ActorConfig-
        like object: ``clip_ratio*``, ``loss_agg_mode``, ``policy_loss.{loss_mode, ...}``,
        ``global_batch_info``). ``loss_agg_mode`` (verl passes it separately) wins over the config's."""
        if isinstance(config, cls):
            return (
                config
                if loss_agg_mode in (None, config.loss_agg_mode)
                else dataclasses.replace(config, loss_agg_mode=loss_agg_mode)
            )
        section = _read(config, "policy_loss")
        batch_info = _read(config, "global_batch_info", {})
        scale = _read(config, "loss_scale_factor", _read(batch_info, "loss_scale_factor"))
        return cls(
            loss_mode=_read(section, "loss_mode", "vanilla"),
            clip_ratio=float(_read(config, "clip_ratio", 0.2)),
            clip_ratio_low=_read(config, "clip_ratio_low"),
            clip_ratio_high=_read(config, "clip_ratio_high"),
            clip_ratio_c=float(_read(config, "clip_ratio_c", 3.0)),
            loss_agg_mode=loss_agg_mode or _read(config, "loss_agg_mode", "token-mean"),
            loss_scale_factor=None if scale is None else float(scale),
            dp_size=int(_read(batch_info, "dp_size", 1)),
            batch_num_tokens=_read(batch_info, "batch_num_tokens"),
            global_batch_size=_read(batch_info, "global_batch_size"),
            source=config,
            **{k: float(v) for k in POLICY_LOSS_SECTION_KEYS if (v := _read(section, k)) is not None},
        )

    def clip_bounds(self) -> tuple[float, float]:
        """``(eps_low, eps_high)`` with None falling back to ``clip_ratio``."""
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return low, high

    def agg_info(self) -> GlobalBatchInfo:
        return GlobalBatchInfo(
            self.dp_size, self.batch_num_tokens, self.global_batch_size, self.loss_scale_factor
        )

    # ----- verl's ActorConfig view, for losses written against verl
    @property
    def global_batch_info(self) -> dict:
        return self.agg_info()._asdict()

    @property
    def policy_loss(self) -> _Section:
        """verl's ``actor.policy_loss`` section: the raw section's keys, with the resolved values."""
        raw = _read(self.source, "policy_loss")
        section = _Section(raw.items() if hasattr(raw, "items") else {})
        section.update(loss_mode=self.loss_mode, **{k: getattr(self, k) for k in POLICY_LOSS_SECTION_KEYS})
        return section

    def get(self, key: str, default=None):
        return getattr(self, key, default)

    def __getattr__(self, name: str):
        # Only reached for names that are not fields: look them up in the raw actor section.
        source = self.__dict__.get("source")
        if source is None or name.startswith("__"):
            raise AttributeError(name)
        value = _read(source, name, _MISSING)
        if value is _MISSING:
            raise AttributeError(f"PolicyLossConfig (and the actor config) has no key {name!r}")
        return value


_MISSING = object()


class PolicyLossOutput(NamedTuple):
    pg_loss: torch.Tensor  # scalar, to back-propagate
    metrics: dict[str, torch.Tensor]  # actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower (detached)


# verl's signature: (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
# rollout_is_weights=None) -> (pg_loss, metrics) or (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower).
PolicyLossFn = Callable[..., tuple]
TypedPolicyLossFn = Callable[[PolicyLossInputs, PolicyLossConfig], PolicyLossOutput]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str, *aliases: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a verl-signature policy loss under ``name`` (and aliases)."""
    return POLICY_LOSSES.register(name, *aliases)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The verl-signature loss registered under ``name``; raises listing the registered names if unknown."""
    return POLICY_LOSSES.get(name)


def verl_policy_loss(typed_fn: TypedPolicyLossFn) -> PolicyLossFn:
    """Wrap a typed loss ``fn(PolicyLossInputs, PolicyLossConfig)`` into verl's call signature."""

    @functools.wraps(typed_fn)
    def loss_fn(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config=None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = PolicyLossConfig.from_config(config, loss_agg_mode)
        inputs = PolicyLossInputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
        pg_loss, metrics = typed_fn(inputs, cfg)
        return pg_loss, dict(metrics)

    loss_fn.typed = typed_fn
    return loss_fn


def compute_policy_loss(inputs: PolicyLossInputs, config) -> PolicyLossOutput:
    """Run the loss named by ``config``'s loss mode (a PolicyLossConfig or a verl-style actor section)."""
    cfg = PolicyLossConfig.from_config(config)
    fn = get_policy_loss_fn(cfg.loss_mode)
    typed = getattr(fn, "typed", None)
    if typed is not None:
        return typed(inputs, cfg)
    kwargs = {}
    if inputs.rollout_is_weights is not None or _accepts(fn, "rollout_is_weights"):
        kwargs["rollout_is_weights"] = inputs.rollout_is_weights
    result = fn(
        old_log_prob=inputs.old_log_prob,
        log_prob=inputs.log_prob,
        advantages=inputs.advantages,
        response_mask=inputs.response_mask,
        loss_agg_mode=cfg.loss_agg_mode,
        config=cfg,
        **kwargs,
    )
    return _as_output(result, cfg.loss_mode)


def _accepts(fn: Callable, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _as_output(result, loss_mode: str) -> PolicyLossOutput:
    """verl's (loss, metrics) or older (loss, clipfrac, ppo_kl, clipfrac_lower) as PolicyLossOutput."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return PolicyLossOutput(result[0], dict(result[1]))
    if isinstance(result, tuple) and len(result) == 4:
        names = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
        metrics = {n: torch.as_tensor(v).detach() for n, v in zip(names, result[1:])}
        return PolicyLossOutput(result[0], metrics)
    raise TypeError(
        f"policy loss {loss_mode!r} returned {type(result).__name__}; expected (pg_loss, metrics_dict) or "
        "(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)"
    )


# ----------------------------------------------------------------------------- helpers


def _log_ratio(inputs: PolicyLossInputs) -> torch.Tensor:
    return torch.clamp(inputs.log_prob - inputs.old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _aggregate(
    pg_losses: torch.Tensor, inputs: PolicyLossInputs, config: PolicyLossConfig, mode: str | None = None
) -> torch.Tensor:
    """Apply the rollout IS weights (if any), then reduce with ``mode`` or the configured mode."""
    if inputs.rollout_is_weights is not None:
        pg_losses = pg_losses * inputs.rollout_is_weights
    mode = config.loss_agg_mode if mode is None else mode
    return agg_loss(pg_losses, inputs.response_mask, mode, *config.agg_info())


def _output(
    pg_loss: torch.Tensor,
    inputs: PolicyLossInputs,
    log_ratio: torch.Tensor,
    clipfrac: torch.Tensor | None = None,
    clipfrac_lower: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Package the loss with the three standard metrics (zeros where a loss has no such notion)."""
    zero = torch.zeros((), device=pg_loss.device)
    metrics = {
        "actor/pg_clipfrac": zero if clipfrac is None else clipfrac.detach(),
        "actor/ppo_kl": masked_mean(-log_ratio, inputs.response_mask).detach(),
        "actor/pg_clipfrac_lower": zero if clipfrac_lower is None else clipfrac_lower.detach(),
    }
    return PolicyLossOutput(pg_loss, metrics)


def _ppo_clip_terms(
    ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(max(-A r, -A clip(r)), -A r, -A clip(r))`` with the asymmetric clip range."""
    low, high = config.clip_bounds()
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    return torch.maximum(unclipped, clipped), unclipped, clipped


def _centred_cov(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token ``(A - mean A)(log pi - mean log pi)`` with means over valid tokens (detached)."""
    adv, logp = advantages.detach(), log_prob.detach()
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


# ----------------------------------------------------------------------------- losses


def vanilla_policy_loss(inputs: PolicyLossInputs, config: PolicyLossConfig) -> PolicyLossOutput:
    """PPO clip + clip-higher + dual-clip.

    ``L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; for ``A < 0`` also ``L <- min(L, -A c)``,
    which bounds the loss of a token whose ratio exploded. ``pg_clipfrac``: tokens where the clipped term
    wins; ``pg_clipfrac_lower``: negative-advantage tokens where the dual clip wins.
    """
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    adv, mask = inputs.advantages, inputs.response_mask
    ppo_losses, unclipped, clipped = _ppo_clip_terms(ratio, adv, config)
    dual_bound = -adv * config.clip_ratio_c
    pg_losses = torch.where(adv < 0, torch.minimum(ppo_losses, dual_bound), ppo_losses)
    clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), mask)
    clipfrac_lower = masked_mean((torch.gt(ppo_losses, dual_bound) & (adv < 0)).float(), mask)
    return _output(_aggregate(pg_losses, inputs, config), inputs, log_ratio, clipfrac, clipfrac_lower)


def gspo_policy_loss(inputs: PolicyLossInputs, config: PolicyLossConfig) -> PolicyLossOutput:
    """Group Sequence Policy Optimisation (Zheng et al. 2025, arXiv 2507.18071, eq. 7 and 10).

    ``s_i = exp(mean_t log r_it)``; per token ``s_it = sg(s_i) * pi_theta / sg(pi_theta)`` so each token's
    gradient is ``s_i * grad log pi``; clipped as PPO. Always aggregated seq-mean-token-mean (as verl).
    """
    log_ratio = _log_ratio(inputs)
    mask = inputs.response_mask
    seq_log_ratio = masked_mean(log_ratio, mask, axis=-1).unsqueeze(-1)
    log_prob = inputs.log_prob
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    pg_losses, unclipped, clipped = _ppo_clip_terms(seq_ratio, inputs.advantages, config)
    clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), mask)
    pg_loss = _aggregate(pg_losses, inputs, config, mode="seq-mean-token-mean")
    return _output(pg_loss, inputs, log_ratio, clipfrac)


def gpg_policy_loss(inputs: PolicyLossInputs, config: PolicyLossConfig) -> PolicyLossOutput:
    """GPG / REINFORCE: ``L = -A log pi_theta`` with no ratio and no clip (arXiv 2504.02546)."""
    pg_losses = -inputs.log_prob * inputs.advantages
    return _output(_aggregate(pg_losses, inputs, config), inputs, _log_ratio(inputs))


def cispo_policy_loss(inputs: PolicyLossInputs, config: PolicyLossConfig) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4): ``L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi``.

    Clipped tokens still get a gradient (scaled by the clipped weight); ``pg_clipfrac`` counts them.
    """
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    low, high = config.clip_bounds()
    weight = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = -weight.detach() * inputs.advantages * inputs.log_prob
    clipfrac = masked_mean(torch.ne(ratio, weight).float(), inputs.response_mask)
    return _output(_aggregate(pg_losses, inputs, config), inputs, log_ratio, clipfrac)


def sapo_policy_loss(inputs: PolicyLossInputs, config: PolicyLossConfig) -> PolicyLossOutput:
    """Soft Adaptive Policy Optimisation (arXiv 2511.20347, eq. 5-6).

    ``L = -A f(r)``, ``f(r) = (4 / tau) sigmoid(tau (r - 1))`` with ``tau = tau_pos`` if ``A > 0`` else
    ``tau_neg``: ``f'(1) = 1`` (PPO at r = 1) and the gradient decays smoothly instead of a hard clip.
    Always aggregated seq-mean-token-mean (as verl).
    """
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    adv = inputs.advantages
    tau = torch.where(adv > 0, torch.full_like(adv, config.tau_pos), torch.full_like(adv, config.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_loss = _aggregate(-gate * adv, inputs, config, mode="seq-mean-token-mean")
    return _output(pg_loss, inputs, log_ratio)


def clip_cov_policy_loss(inputs: PolicyLossInputs, config: PolicyLossConfig) -> PolicyLossOutput:
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617, sec. 4): PPO loss, and among the tokens PPO did not
    clip whose ``cov(A, log pi)`` lies in ``(clip_cov_lb, clip_cov_ub)`` a random
    ``max(1, int(clip_cov_ratio * #valid))`` lose their gradient. ``pg_clipfrac``: share of those tokens.
    """
    log_ratio = _log_ratio(inputs)
    mask = inputs.response_mask
    ppo_losses, unclipped, clipped = _ppo_clip_terms(torch.exp(log_ratio), inputs.advantages, config)
    cov = _centred_cov(inputs.advantages, inputs.log_prob, mask)
    valid = mask > 0
    candidates = valid & ~(clipped > unclipped) & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    cand_idx = torch.nonzero(candidates.reshape(-1)).squeeze(-1)
    num_clip = max(int(config.clip_cov_ratio * valid.sum().item()), 1)
    chosen = cand_idx[torch.randperm(cand_idx.numel(), device=cand_idx.device)[:num_clip]]
    keep = torch.ones_like(ppo_losses).reshape(-1).index_fill_(0, chosen, 0.0).reshape(ppo_losses.shape)
    clipfrac = masked_mean((keep == 0).float(), mask)
    return _output(_aggregate(ppo_losses * keep, inputs, config), inputs, log_ratio, clipfrac)


def kl_cov_policy_loss(inputs: PolicyLossInputs, config: PolicyLossConfig) -> PolicyLossOutput:
    """KL-Cov (arXiv 2505.22617, sec. 4): unclipped ``-A r``, plus ``ppo_kl_coef * |log r|`` on the
    ``max(1, int(kl_cov_ratio * #valid))`` valid tokens of largest ``cov(A, log pi)``.
    ``pg_clipfrac``: share of penalised tokens (verl reports no clipfrac and |log r| as ppo_kl).
    """
    log_ratio = _log_ratio(inputs)
    mask = inputs.response_mask
    adv = inputs.advantages
    base = -adv * torch.exp(log_ratio)
    valid_idx = torch.nonzero((mask > 0).reshape(-1)).squeeze(-1)
    penalised = torch.zeros(base.numel(), dtype=torch.bool, device=base.device)
    if valid_idx.numel() > 0:
        cov = _centred_cov(adv, inputs.log_prob, mask).reshape(-1)[valid_idx]
        k = max(1, int(valid_idx.numel() * config.kl_cov_ratio))
        penalised[valid_idx[torch.topk(cov, k).indices]] = True
    penalised = penalised.reshape(base.shape)
    pg_losses = torch.where(penalised, base + config.ppo_kl_coef * log_ratio.abs(), base)
    clipfrac = masked_mean(penalised.float(), mask)
    return _output(_aggregate(pg_losses, inputs, config), inputs, log_ratio, clipfrac)


# ----------------------------------------------------------------------------- registration (verl names)

compute_policy_loss_vanilla = register_policy_loss("vanilla")(verl_policy_loss(vanilla_policy_loss))
compute_policy_loss_gspo = register_policy_loss("gspo")(verl_policy_loss(gspo_policy_loss))
compute_policy_loss_gpg = register_policy_loss("gpg")(verl_policy_loss(gpg_policy_loss))
compute_policy_loss_cispo = register_policy_loss("cispo")(verl_policy_loss(cispo_policy_loss))
compute_policy_loss_sapo = register_policy_loss("sapo")(verl_policy_loss(sapo_policy_loss))
compute_policy_loss_clip_cov = register_policy_loss("clip_cov")(verl_policy_loss(clip_cov_policy_loss))
compute_policy_loss_kl_cov = register_policy_loss("kl_cov")(verl_policy_loss(kl_cov_policy_loss))
