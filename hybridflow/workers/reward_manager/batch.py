"""The batch reward manager: one scorer call for the whole batch (verl's ``BatchRewardManager``).

The scorer is called as ``compute_score(data_sources=[...], solution_strs=[...], ground_truths=[...],
extra_infos=[...], **reward_kwargs)`` and must return a list of ``B`` scores (floats or dicts with
``"score"``). Useful when scoring batches is cheaper (a remote judge, a vectorised verifier). The one
call is limited to ``batch_timeout_s`` (``score_timeout_s`` is per sample and does not apply).
"""

from __future__ import annotations

from hybridflow.utils.reward_score import default_compute_score
from hybridflow.workers.reward_manager.naive import (
    RESPONSE_PREFIX_CHARS,
    RewardManagerBase,
    RewardSample,
    ScoreOutcome,
    timeout_message,
)
from hybridflow.workers.reward_manager.registry import register_reward_manager
from hybridflow.workers.reward_manager.timeouts import ScoreTimeout, call_with_time_limit


def default_batch_compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list:
    """``default_compute_score`` mapped over the batch (used when no batch scorer is given)."""
    return [
        default_compute_score(ds, sol, gt, info, **kwargs)
        for ds, sol, gt, info in zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)
    ]


def _first(samples: list[RewardSample]) -> str:
    if not samples:
        return "none"
    s = samples[0]
    return (
        f"data_source={s.data_source!r}, sample {s.index}, "
        f"response[:{RESPONSE_PREFIX_CHARS}]={s.response_str[:RESPONSE_PREFIX_CHARS]!r}"
    )


@register_reward_manager("batch")
class BatchRewardManager(RewardManagerBase):
    """Scores the batch in one call; if that call raises, every sample failed (raise, or zero them all)."""

    def __init__(self, tokenizer, num_examine: int, compute_score=None, **kwargs) -> None:
        super().__init__(tokenizer, num_examine, compute_score or default_batch_compute_score, **kwargs)

    def score_samples(self, samples: list[RewardSample]) -> tuple[list[ScoreOutcome], dict[str, list]]:
        message = timeout_message(None, True, self.batch_timeout_s)
        try:
            results = call_with_time_limit(
                lambda: self.compute_score(
                    data_sources=[s.data_source for s in samples],
                    solution_strs=[s.response_str for s in samples],
                    ground_truths=[s.ground_truth for s in samples],
                    extra_infos=[s.extra_info for s in samples],
                    **self.score_kwargs,
                ),
                self.batch_timeout_s,
                message,
                describe=lambda: f"batch of {len(samples)} samples, the first: {_first(samples)}",
            )
        except (Exception, ScoreTimeout) as exc:  # no per-sample attribution: every sample failed
            return [ScoreOutcome(error=exc) for _ in samples], {}
        results = list(results)
        if len(results) != len(samples):
            raise ValueError(f"batch compute_score returned {len(results)} scores for {len(samples)} samples")
        return [ScoreOutcome(result=r) for r in results], {}
