"""``dapo``: ``naive`` plus DAPO's overlong penalty (``reward_model.overlong_buffer``), sample by sample:
``min(-(L - (max_resp_len - buffer_len)) / buffer_len · penalty_factor, 0)`` added to the score, with
``overlong_reward``/``overlong`` extras when ``overlong_buffer.log``."""

from __future__ import annotations

from hybridflow.protocol import DataProto
from hybridflow.workers.reward_loop.naive import NaiveRewardManager
from hybridflow.workers.reward_loop.registry import register
from hybridflow.workers.reward_manager.dapo import cfg_get, overlong_penalty


@register("dapo")
class DAPORewardManager(NaiveRewardManager):
    def __init__(
        self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None
    ):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        buffer = cfg_get(cfg_get(config, "reward_model"), "overlong_buffer") or {}
        self.enabled = bool(cfg_get(buffer, "enable", False))
        self.buffer_len = int(cfg_get(buffer, "len", 0) or 0)
        self.penalty_factor = float(cfg_get(buffer, "penalty_factor", 1.0))
        self.log = bool(cfg_get(buffer, "log", False))
        self.max_resp_len = cfg_get(cfg_get(config, "data"), "max_response_length")
        if self.enabled and (self.max_resp_len is None or self.buffer_len <= 0):
            raise ValueError(
                "dapo reward manager: overlong_buffer.enable needs data.max_response_length and "
                f"overlong_buffer.len > 0 (got {self.max_resp_len}, {self.buffer_len})"
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
