"""``dapo``: ``naive`` plus DAPO's overlong penalty, sample by sample, with verl's reward-loop keys:
``reward_model.reward_kwargs.overlong_buffer_cfg`` (``enable``, ``len``, ``penalty_factor``, ``log``) and
``reward_kwargs.max_resp_len`` (else verl's older ``reward_model.overlong_buffer`` with
``data.max_response_length``: :func:`~hybridflow.workers.reward_manager.dapo.overlong_settings`).
``min(-(L - (max_resp_len - buffer_len)) / buffer_len · penalty_factor, 0)`` is added to the score, with
``overlong_reward``/``overlong`` extras when ``log``. ``reward_kwargs.strict_box_verify``, when set, goes to
``compute_score`` as verl's DAPO manager passes it (a function that does not take it is refused at start)."""

from __future__ import annotations

import inspect

from hybridflow.protocol import DataProto
from hybridflow.workers.reward_loop.naive import NaiveRewardManager
from hybridflow.workers.reward_loop.registry import register
from hybridflow.workers.reward_manager.dapo import cfg_get, overlong_penalty, overlong_settings


def _takes(fn, name: str) -> bool:
    target = getattr(fn, "target", None)
    fn = target() if callable(target) else fn
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@register("dapo")
class DAPORewardManager(NaiveRewardManager):
    def __init__(
        self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None
    ):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        rm = cfg_get(config, "reward_model") or {}
        buffer, self.max_resp_len = overlong_settings(
            rm, cfg_get(cfg_get(config, "data"), "max_response_length")
        )
        self.enabled = bool(cfg_get(buffer, "enable", False))
        self.buffer_len = int(cfg_get(buffer, "len", 0) or 0)
        self.penalty_factor = float(cfg_get(buffer, "penalty_factor", 1.0))
        self.log = bool(cfg_get(buffer, "log", False))
        if self.enabled and (self.max_resp_len is None or self.buffer_len <= 0):
            raise ValueError(
                "dapo reward manager: the overlong penalty needs max_resp_len and overlong_buffer_cfg.len "
                f"> 0 (got {self.max_resp_len}, {self.buffer_len})"
            )
        strict = cfg_get(cfg_get(rm, "reward_kwargs") or {}, "strict_box_verify")
        if strict is None:  # unset: not passed (verl passes False; our scorers would refuse the name)
            pass
        elif _takes(self.compute_score, "strict_box_verify"):
            self.score_kwargs["strict_box_verify"] = bool(strict)
        else:
            raise ValueError(
                f"reward_model.reward_kwargs.strict_box_verify={strict}: the reward function takes no "
                "strict_box_verify argument (verl's DAPO manager passes it to compute_score)"
            )

    async def run_single(self, data: DataProto) -> dict:
        result = await super().run_single(data)
        if self.enabled:
            length = int(data.batch["attention_mask"][0, -data.batch["responses"].shape[-1] :].sum())
            penalty = overlong_penalty(length, int(self.max_resp_len), self.buffer_len, self.penalty_factor)
            result["reward_score"] += penalty
            if self.log:
                result["reward_extra_info"].update(overlong_reward=penalty, overlong=penalty < 0)
        return result
