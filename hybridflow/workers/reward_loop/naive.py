"""``naive``: the reward function on each sample, its result as the score (verl's reward-loop naive).

A float result is the score and also the ``acc`` extra (verl's); a dict gives ``score`` and its other keys
as extras. A scorer that raises, times out (``reward_model.score_timeout_s``) or returns a non-number or
NaN raises :class:`~hybridflow.workers.reward_manager.RewardScoreError` naming the sample, or with
``reward_model.on_score_error=zero`` scores 0 with ``score_error``/``timed_out`` extras.
"""

from __future__ import annotations

from hybridflow.protocol import DataProto
from hybridflow.workers.reward_loop.base import RewardManagerBase
from hybridflow.workers.reward_loop.registry import register
from hybridflow.workers.reward_manager.naive import RewardSample, RewardScoreError, _describe, _parse
from hybridflow.workers.reward_manager.timeouts import ScoreTimeout


def resolve_one(sample: RewardSample, outcome, on_score_error: str) -> tuple[float, dict]:
    """``(score, extras)`` from one outcome, by ``on_score_error`` (``raise`` | ``zero``)."""
    score, extras, problem = _parse(outcome)
    if problem is not None:
        if on_score_error == "raise":
            raise RewardScoreError(_describe(sample, problem)) from outcome.error
        return 0.0, {"score_error": 1, "timed_out": int(isinstance(outcome.error, ScoreTimeout))}
    extras = {**outcome.result} if isinstance(outcome.result, dict) else {"acc": score}  # verl keeps "score"
    if on_score_error == "zero":
        extras = {**extras, "score_error": 0, "timed_out": 0}
    return score, extras


@register("naive")
class NaiveRewardManager(RewardManagerBase):
    """One reward-function call per sample (module docstring)."""

    async def run_single(self, data: DataProto) -> dict:
        sample = self.sample(data)
        outcome = await self.call_score(sample, self.score_timeout_s)
        score, extras = resolve_one(sample, outcome, self.on_score_error)
        return {"reward_score": score, "reward_extra_info": extras}
