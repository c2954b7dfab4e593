"""Rule-based reward scorers, dispatched by ``data_source`` (verl's ``default_compute_score``).

Built in: ``openai/gsm8k`` (:mod:`.gsm8k`), ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``
and ``HuggingFaceH4/MATH-500`` (:mod:`.math`; Math-Verify with ``use_math_verify=True``) as in verl,
and ``hybridflow/arithmetic`` (:mod:`.arithmetic`). Each module's own ``compute_score`` keeps verl's
signature (``gsm8k.compute_score(solution_str, ground_truth, method=...)``); what is registered here
has verl's custom-reward signature::

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

A dict result carries the reward under ``"score"`` plus extra fields the reward manager logs. Add a
scorer by decorating it with ``@register_scorer("my/data_source", "alias", ...)``; the dispatcher
never special-cases an entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.utils.registry import Registry

ScoreFn = Callable[..., float | dict]

SCORERS: Registry[ScoreFn] = Registry("reward scorer for data_source")


def register_scorer(data_source: str, *aliases: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator: score rows whose ``data_source`` is ``data_source`` or one of ``aliases``."""
    return SCORERS.register(data_source, *aliases)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs
) -> float | dict:
    """Score ``solution_str`` with the scorer registered for ``data_source``.

    Numbers (and bools) come back as ``float``; dicts are returned as they are and must hold ``"score"``.
    An unknown ``data_source`` raises an error listing the registered ones.
    """
    result = SCORERS.get(data_source)(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"scorer for {data_source!r} returned a dict without 'score': {sorted(result)}")
        return result
    return float(result)


# Built-in scorers register themselves on import.
from hybridflow.utils.reward_score import arithmetic, gsm8k, math  # noqa: E402, F401

__all__ = ["SCORERS", "default_compute_score", "register_scorer"]
