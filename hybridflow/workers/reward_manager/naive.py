"""The naive reward manager (one scorer call per sample) and the machinery all managers share.

Pipeline of every manager's ``__call__(data, return_dict=False)``:

1. if ``rm_scores`` is in ``data.batch`` (a reward model already ran), return it unchanged;
2. :func:`decode_samples`: valid prompt/response ids → strings (``skip_special_tokens=True``), plus
   ``reward_model[i]["ground_truth"]``, ``data[reward_fn_key][i]`` and ``extra_info[i]``;
3. ``score_samples`` (the part each manager defines) → one :class:`ScoreOutcome` per sample, each
   scorer call limited to ``score_timeout_s`` and the whole batch to ``batch_timeout_s``
   (:mod:`.timeouts`);
4. :func:`resolve_scores`: validate (a raised error, a timeout, a NaN/inf or a non-number is never
   silently zeroed: ``RewardScoreError`` naming the sample, unless ``on_score_error="zero"``, which
   scores it 0 and marks it in the ``score_error`` / ``timed_out`` extra columns), split dict results
   into the score and extra fields;
5. ``shape_scores`` (optional per-manager adjustment, e.g. DAPO's overlong penalty);
6. write each score on the sample's last generated token (:func:`score_positions`) of
   ``reward_tensor (B, T_r) float32``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.protocol import DataProto
from hybridflow.utils.reward_score import default_compute_score
from hybridflow.workers.reward_manager.registry import register_reward_manager
from hybridflow.workers.reward_manager.timeouts import ScoreTimeout, call_with_time_limit, effective_limit

logger = logging.getLogger(__name__)

ON_SCORE_ERROR_MODES = ("raise", "zero")
RESPONSE_PREFIX_CHARS = 200  # how much of a response an error message quotes
# Library defaults of reward_model.score_timeout_s / batch_timeout_s (ppo_trainer.yaml holds the same).
DEFAULT_SCORE_TIMEOUT_S = 300.0  # one scorer call (verl's prime manager gives a sample 300 s)
DEFAULT_BATCH_TIMEOUT_S = 1800.0  # all of one batch's scoring


class RewardScoreError(RuntimeError):
    """A scorer raised, or returned NaN/inf/a non-number, for a sample (names source, index, response)."""


@dataclass
class RewardSample:
    """One row of the batch, decoded for scoring."""

    index: int
    data_source: str
    prompt_str: str
    response_str: str
    ground_truth: Any
    extra_info: dict | None
    valid_response_length: int


@dataclass
class ScoreOutcome:
    """What scoring one sample produced: the scorer's raw result, or the exception it raised."""

    result: Any = None
    error: BaseException | None = None


@dataclass
class ResolvedScores:
    """Validated scores ``(B,)`` and extra fields, each a list of length ``B``."""

    scores: list[float]
    extra_info: dict[str, list] = field(default_factory=dict)


def _non_tensor(data: DataProto, key: str) -> Any:
    if key not in data.non_tensor_batch:
        raise KeyError(
            f"reward manager: data.non_tensor_batch has no {key!r} (keys: {sorted(data.non_tensor_batch)})"
        )
    return data.non_tensor_batch[key]


def _ground_truth(reward_model: Any, index: int) -> Any:
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise KeyError(
            f"reward manager: sample {index}: reward_model has no 'ground_truth': {reward_model!r:.200}"
        )
    return reward_model["ground_truth"]


def decode_samples(data: DataProto, tokenizer, reward_fn_key: str = "data_source") -> list[RewardSample]:
    """Decode the valid part of each row.

    ``prompts (B, T_p)`` is left-padded, ``responses (B, T_r)`` right-padded and
    ``attention_mask (B, T_p + T_r)`` covers both, so valid lengths are mask sums over each part.
    """
    prompts, responses = data.batch["prompts"], data.batch["responses"]
    mask = data.batch["attention_mask"]
    t_p = prompts.shape[1]
    prompt_lens = mask[:, :t_p].sum(-1).tolist()
    response_lens = mask[:, t_p:].sum(-1).tolist()
    prompt_strs = tokenizer.batch_decode(
        [prompts[i, t_p - n :].tolist() for i, n in enumerate(prompt_lens)], skip_special_tokens=True
    )
    response_strs = tokenizer.batch_decode(
        [responses[i, :n].tolist() for i, n in enumerate(response_lens)], skip_special_tokens=True
    )
    reward_model = _non_tensor(data, "reward_model")
    data_sources = _non_tensor(data, reward_fn_key)
    extra_infos = data.non_tensor_batch.get("extra_info")
    tool_rewards = data.non_tensor_batch.get("tool_rewards")  # multi-turn: what the tools scored
    if tool_rewards is not None:
        base = list(extra_infos) if extra_infos is not None else [None] * len(tool_rewards)
        extra_infos = [
            {**(info or {}), "tool_rewards": float(r)} for info, r in zip(base, tool_rewards, strict=True)
        ]
    turn_scores = data.non_tensor_batch.get("turn_scores")  # multi-turn: an interaction's, per reply
    if turn_scores is not None:
        base = list(extra_infos) if extra_infos is not None else [None] * len(turn_scores)
        extra_infos = [
            {**(info or {}), "turn_scores": list(s)} for info, s in zip(base, turn_scores, strict=True)
        ]
    return [
        RewardSample(
            index=i,
            data_source=data_sources[i],
            prompt_str=prompt_strs[i],
            response_str=response_strs[i],
            ground_truth=_ground_truth(reward_model[i], i),
            extra_info=extra_infos[i] if extra_infos is not None else None,
            valid_response_length=int(response_lens[i]),
        )
        for i in range(len(data))
    ]


def score_positions(data: DataProto) -> torch.Tensor:
    """``(B,)`` where each sample's sequence-level score goes: its last generated token, the last
    position with ``response_mask == 1``.

    Not the attended length - 1: a multi-turn response truncated inside a tool turn ends on masked
    tool tokens, and a score there is dropped by every estimator (GAE multiplies by the mask). Without
    a ``response_mask`` the response part of ``attention_mask`` is used. An empty response has no
    last token: position 0 keeps its score in the tensor."""
    mask = data.batch.get("response_mask", None)
    if mask is None:
        mask = data.batch["attention_mask"][:, -data.batch["responses"].shape[1] :]
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).amax(dim=-1)


def timeout_message(seconds: float | None, from_batch: bool, batch_timeout_s: float | None) -> str:
    """What a timed-out sample's error says: which limit ran out."""
    if from_batch:
        return f"the batch's scoring ran past reward_model.batch_timeout_s={batch_timeout_s:g}s"
    return f"scorer timed out after reward_model.score_timeout_s={seconds:g}s"


def call_scorer(
    compute_score,
    sample: RewardSample,
    score_kwargs: dict,
    score_timeout_s: float | None = None,
    deadline: float | None = None,
    batch_timeout_s: float | None = None,
) -> ScoreOutcome:
    """Run ``compute_score`` on one sample with verl's keyword arguments, for at most
    ``score_timeout_s`` and not past the batch's ``deadline`` (``time.monotonic()``); capture any
    exception or timeout as the outcome."""
    seconds, from_batch = effective_limit(score_timeout_s, deadline)
    message = timeout_message(score_timeout_s, from_batch, batch_timeout_s)
    try:
        result = call_with_time_limit(
            lambda: compute_score(
                data_source=sample.data_source,
                solution_str=sample.response_str,
                ground_truth=sample.ground_truth,
                extra_info=sample.extra_info,
                **score_kwargs,
            ),
            seconds,
            message,
            describe=lambda: _describe(sample, message),
        )
    except (Exception, ScoreTimeout) as exc:  # reported (or zeroed) by resolve_scores, never dropped
        return ScoreOutcome(error=exc)
    return ScoreOutcome(result=result)


def _parse(outcome: ScoreOutcome) -> tuple[float, dict, str | None]:
    """``(score, extra fields, problem)``; ``problem`` is None when the outcome is a finite number."""
    if isinstance(outcome.error, ScoreTimeout):
        return 0.0, {}, str(outcome.error)
    if outcome.error is not None:
        return 0.0, {}, f"scorer raised {type(outcome.error).__name__}: {outcome.error}"
    result, extras = outcome.result, {}
    if isinstance(result, dict):
        if "score" not in result:
            return 0.0, {}, f"scorer returned a dict without 'score' (keys {sorted(result)})"
        extras = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    try:
        score = float(result)
    except (TypeError, ValueError):
        return 0.0, {}, f"scorer returned a non-number {result!r:.100}"
    if not math.isfinite(score):
        return 0.0, {}, f"scorer returned {score}"
    return score, extras, None


def _describe(sample: RewardSample, problem: str) -> str:
    return (
        f"reward scoring failed for data_source={sample.data_source!r}, sample {sample.index}: {problem}; "
        f"response[:{RESPONSE_PREFIX_CHARS}]={sample.response_str[:RESPONSE_PREFIX_CHARS]!r}, "
        f"ground_truth={sample.ground_truth!r}. Set reward_model.on_score_error=zero to score it 0 instead."
    )


def resolve_scores(
    samples: list[RewardSample], outcomes: list[ScoreOutcome], on_score_error: str
) -> ResolvedScores:
    """Validate outcomes; raise ``RewardScoreError`` on the first bad one, or zero it (``"zero"``)."""
    scores, per_sample, errors, first_problem = [], [], [], None
    for sample, outcome in zip(samples, outcomes, strict=True):
        score, extras, problem = _parse(outcome)
        if problem is not None and on_score_error == "raise":
            raise RewardScoreError(_describe(sample, problem)) from outcome.error
        if problem is not None and first_problem is None:
            first_problem = _describe(sample, problem)
        scores.append(score)
        per_sample.append(extras)
        errors.append(int(problem is not None))
    if first_problem is not None:
        logger.warning(
            "%d of %d samples scored 0 after scoring errors; first: %s",
            sum(errors),
            len(errors),
            first_problem,
        )
    keys = list(dict.fromkeys(k for extras in per_sample for k in extras))
    info = {k: [extras.get(k) for extras in per_sample] for k in keys}
    if on_score_error == "zero":
        info["score_error"] = errors
        info["timed_out"] = [int(isinstance(o.error, ScoreTimeout)) for o in outcomes]
    return ResolvedScores(scores, info)


def print_examples(samples: list[RewardSample], scores: list[float], num_examine: int) -> None:
    """Print up to ``num_examine`` samples per data_source (prompt, response, ground truth, score)."""
    printed: dict[str, int] = {}
    for sample, score in zip(samples, scores):
        if printed.get(sample.data_source, 0) >= num_examine:
            continue
        printed[sample.data_source] = printed.get(sample.data_source, 0) + 1
        print("[prompt]", sample.prompt_str)
        print("[response]", sample.response_str)
        print("[ground_truth]", sample.ground_truth)
        print("[score]", score)


def check_timeout(name: str, seconds: float | None) -> float | None:
    """A positive number of seconds, or None (no limit)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"reward_model.{name} must be a positive number of seconds or null, got {seconds!r}")
    return float(seconds)


def check_on_score_error(mode: str) -> str:
    if mode not in ON_SCORE_ERROR_MODES:
        raise ValueError(f"on_score_error={mode!r}; choose one of {list(ON_SCORE_ERROR_MODES)}")
    return mode


class RewardManagerBase:
    """The shared ``__call__`` pipeline (module docstring); subclasses define ``score_samples``."""

    def __init__(
        self,
        tokenizer,
        num_examine: int,
        compute_score=None,
        reward_fn_key: str = "data_source",
        on_score_error: str = "raise",
        score_timeout_s: float | None = DEFAULT_SCORE_TIMEOUT_S,
        batch_timeout_s: float | None = DEFAULT_BATCH_TIMEOUT_S,
        **kwargs,
    ) -> None:
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.on_score_error = check_on_score_error(on_score_error)
        self.score_timeout_s = check_timeout("score_timeout_s", score_timeout_s)
        self.batch_timeout_s = check_timeout("batch_timeout_s", batch_timeout_s)
        self.score_kwargs = kwargs  # forwarded to every compute_score call (verl's reward_kwargs)

    def batch_deadline(self) -> float | None:
        """``time.monotonic()`` by which this batch's scoring must end (None: no limit)."""
        return None if self.batch_timeout_s is None else time.monotonic() + self.batch_timeout_s

    def score_samples(self, samples: list[RewardSample]) -> tuple[list[ScoreOutcome], dict[str, list]]:
        """One outcome per sample, plus extra-info columns of length B the manager wants logged."""
        raise NotImplementedError

    def shape_scores(
        self, samples: list[RewardSample], scores: list[float]
    ) -> tuple[list[float], dict[str, list]]:
        """Adjust validated scores (default: unchanged); returns new scores and extra-info columns."""
        return scores, {}

    def __call__(self, data: DataProto, return_dict: bool = False):
        """``reward_tensor (B, T_r) float32``, or ``{"reward_tensor", "reward_extra_info"}``."""
        if "rm_scores" in data.batch.keys():  # a reward model already scored the batch (verl behaviour)
            rm_scores = data.batch["rm_scores"]
            return {"reward_tensor": rm_scores, "reward_extra_info": {}} if return_dict else rm_scores
        samples = decode_samples(data, self.tokenizer, self.reward_fn_key)
        outcomes, columns = self.score_samples(samples)
        resolved = resolve_scores(samples, outcomes, self.on_score_error)
        scores, shaping_columns = self.shape_scores(samples, resolved.scores)
        reward_tensor = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        positions = score_positions(data).tolist()
        for sample, score in zip(samples, scores):
            reward_tensor[sample.index, positions[sample.index]] = score
        print_examples(samples, scores, self.num_examine)
        if not return_dict:
            return reward_tensor
        return {
            "reward_tensor": reward_tensor,
            "reward_extra_info": {**resolved.extra_info, **columns, **shaping_columns},
        }


@register_reward_manager("naive")
class NaiveRewardManager(RewardManagerBase):
    """Calls ``compute_score`` once per sample, in order, in this process (time limits: :mod:`.timeouts`)."""

    def score_samples(self, samples: list[RewardSample]) -> tuple[list[ScoreOutcome], dict[str, list]]:
        deadline = self.batch_deadline()
        outcomes = []
        for sample in samples:
            outcomes.append(
                call_scorer(
                    self.compute_score,
                    sample,
                    self.score_kwargs,
                    self.score_timeout_s,
                    deadline,
                    self.batch_timeout_s,
                )
            )
            if outcomes[-1].error is not None and self.on_score_error == "raise":
                break  # the run stops on this sample: scoring the rest would only delay the error
        outcomes += [ScoreOutcome(result=0.0) for _ in range(len(samples) - len(outcomes))]  # never read
        return outcomes, {}
