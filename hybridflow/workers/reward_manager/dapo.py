"""The DAPO reward manager: naive scoring plus the overlong-response penalty.

DAPO (Yu et al., 2025, "DAPO: an open-source LLM reinforcement learning system at scale", eq. 13):
with ``L`` the response length, ``L_max = max_resp_len`` and a buffer of ``L_cache = len`` tokens,

    R_length(L) = 0                                  if L <= L_max - L_cache
                = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max

scaled by ``penalty_factor``, i.e. ``min(-(L - (L_max - L_cache)) / L_cache * penalty_factor, 0)``,
added to the task score. ``overlong_buffer_cfg = {"enable", "len", "penalty_factor", "log"}``; with
``log`` the penalty goes to extra info ``overlong_reward`` and ``overlong`` (penalty < 0).
"""

from __future__ import annotations

import warnings
from typing import Any

from hybridflow.workers.reward_manager.naive import NaiveRewardManager, RewardSample
from hybridflow.workers.reward_manager.registry import register_reward_manager


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a dict, a DictConfig or an attribute object."""
    if cfg is None:
        return default
    if hasattr(cfg, "get"):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def overlong_penalty(length: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """``min(-(length - (max_resp_len - buffer_len)) / buffer_len * penalty_factor, 0)``."""
    exceed = length - (max_resp_len - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


def overlong_settings(reward_model_cfg: Any, data_max_response_length: int | None) -> tuple[Any, int | None]:
    """``(overlong_buffer_cfg, max_resp_len)`` as verl's DAPO recipe sets them, for both DAPO managers:
    ``reward_model.reward_kwargs.overlong_buffer_cfg`` and ``reward_kwargs.max_resp_len`` (verl's reward
    loop and its recipe's command line); else verl's older ``reward_model.overlong_buffer`` with
    ``data.max_response_length``. Both sources enabled at once is refused (one would be ignored)."""
    kwargs = cfg_get(reward_model_cfg, "reward_kwargs") or {}
    legacy = cfg_get(reward_model_cfg, "overlong_buffer")
    cfg = cfg_get(kwargs, "overlong_buffer_cfg")
    if cfg is None:
        return legacy, data_max_response_length
    if cfg_get(legacy, "enable", False):
        raise ValueError(
            "reward_model.reward_kwargs.overlong_buffer_cfg and reward_model.overlong_buffer.enable=true "
            "both configure DAPO's overlong penalty: keep one (verl's recipe sets "
            "reward_kwargs.overlong_buffer_cfg with reward_kwargs.max_resp_len)"
        )
    max_resp_len = cfg_get(kwargs, "max_resp_len")
    if max_resp_len is None and cfg_get(cfg, "enable", False):
        raise ValueError(
            "reward_model.reward_kwargs.overlong_buffer_cfg needs reward_model.reward_kwargs.max_resp_len "
            "(verl asserts the same): set it to data.max_response_length"
        )
    if max_resp_len is not None and int(max_resp_len) < int(cfg_get(cfg, "len", 0) or 0):
        raise ValueError(
            f"reward_model.reward_kwargs.max_resp_len={max_resp_len} must be >= overlong_buffer_cfg.len="
            f"{cfg_get(cfg, 'len')} (verl asserts the same)"
        )
    return cfg, None if max_resp_len is None else int(max_resp_len)


DAPO_REWARD_KWARGS = ("overlong_buffer_cfg", "max_resp_len", "strict_box_verify")  # what verl's DAPO reads


@register_reward_manager("dapo")
class DAPORewardManager(NaiveRewardManager):
    """``naive`` + the overlong penalty when ``overlong_buffer_cfg.enable``."""

    def __init__(
        self,
        tokenizer,
        num_examine: int,
        compute_score=None,
        reward_fn_key: str = "data_source",
        on_score_error: str = "raise",
        max_resp_len: int | None = None,
        overlong_buffer_cfg: Any = None,
        **kwargs,
    ) -> None:
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, on_score_error, **kwargs)
        self.enabled = bool(cfg_get(overlong_buffer_cfg, "enable", False))
        self.max_resp_len = max_resp_len
        self.buffer_len = int(cfg_get(overlong_buffer_cfg, "len", 0))
        self.penalty_factor = float(cfg_get(overlong_buffer_cfg, "penalty_factor", 1.0))
        self.log = bool(cfg_get(overlong_buffer_cfg, "log", False))
        if self.enabled:
            if max_resp_len is None:
                raise ValueError("dapo reward manager: overlong_buffer.enable needs max_resp_len")
            if self.buffer_len <= 0:
                raise ValueError(
                    f"dapo reward manager: overlong_buffer.len must be > 0, got {self.buffer_len}"
                )
            if self.buffer_len > max_resp_len:
                warnings.warn(
                    f"overlong_buffer.len={self.buffer_len} > max_resp_len={max_resp_len}: every response "
                    "length is penalised",
                    stacklevel=2,
                )

    def shape_scores(
        self, samples: list[RewardSample], scores: list[float]
    ) -> tuple[list[float], dict[str, list]]:
        if not self.enabled:
            return scores, {}
        penalties = [
            overlong_penalty(s.valid_response_length, self.max_resp_len, self.buffer_len, self.penalty_factor)
            for s in samples
        ]
        shaped = [score + p for score, p in zip(scores, penalties)]
        columns = {"overlong_reward": penalties, "overlong": [p < 0 for p in penalties]} if self.log else {}
        return shaped, columns
