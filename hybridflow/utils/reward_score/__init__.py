"""Rule-based reward scorers, dispatched by ``data_source`` (verl's ``default_compute_score``).

Built in: ``openai/gsm8k`` (:mod:`.gsm8k`), ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``
and ``HuggingFaceH4/MATH-500`` (:mod:`.math`; Math-Verify with ``use_math_verify=True``) as in verl,
``hybridflow/arithmetic`` (:mod:`.arithmetic`), and ``codecontests``/``apps``/``codeforces``/``taco``
(:mod:`.sandbox_fusion`: test cases run on a SandboxFusion server, ``sandbox_fusion_url=``). Each
module's own ``compute_score`` keeps verl's signature (``gsm8k.compute_score(solution_str,
ground_truth, method=...)``); what is registered here has verl's custom-reward signature::

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

A dict result carries the reward under ``"score"`` plus extra fields the reward manager logs. Add a
scorer by decorating it with ``@register_scorer("my/data_source", "alias", ...)``; the dispatcher
never special-cases an entry.

Extra keyword arguments (``reward_model.reward_kwargs``) reach each scorer only if its signature
names them (a scorer with ``**kwargs`` takes them all), so ``use_math_verify=True`` on a run mixing
MATH and gsm8k rows reaches the MATH rows only. A keyword no scorer takes is an error
(:class:`ScoreKwargsError`), never silently dropped; :func:`score_kwargs_problems` reports it at
start-up for the data sources of a run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

# The built-in scorers register themselves into SCORERS on import.
from hybridflow.utils.reward_score import arithmetic, gsm8k, math, sandbox_fusion  # noqa: F401
from hybridflow.utils.reward_score.registry import SCORERS, ScoreFn, register_scorer

# The arguments every scorer receives; anything else it names is an extra keyword it accepts.
DISPATCH_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


class ScoreKwargsError(TypeError):
    """Reward keyword arguments that no scorer accepts: a config mistake, not a scoring failure."""


@cache
def accepted_kwargs(fn: Callable) -> frozenset[str] | None:
    """The extra keyword names ``fn`` accepts beyond :data:`DISPATCH_ARGS`; ``None`` when it takes
    ``**kwargs`` (then it accepts any)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    named = (p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return frozenset(name for name in named if name not in DISPATCH_ARGS)


def _describe(accepted: frozenset[str] | None) -> str:
    if accepted is None:
        return "any (**kwargs)"
    return ", ".join(sorted(accepted)) if accepted else "none"


def score_kwargs_problems(kwargs: Iterable[str], data_sources: Iterable[str] | None = None) -> list[str]:
    """One line per keyword in ``kwargs`` that none of the scorers for ``data_sources`` accepts
    (``None``: every registered scorer), naming each scorer and what it accepts. Data sources with no
    registered scorer are skipped (the dispatcher reports them with the registered names)."""
    names = SCORERS.names() if data_sources is None else sorted({str(s) for s in data_sources})
    by_fn: dict[Callable, list[str]] = {}
    for name in (n for n in names if n in SCORERS):
        by_fn.setdefault(SCORERS.get(name), []).append(name)
    unaccepted = [k for k in kwargs if not any(_accepts(fn, k) for fn in by_fn)]
    if not unaccepted:
        return []
    scope = "registered scorer" if data_sources is None else "scorer of this run's data sources"
    table = "; ".join(f"{' | '.join(n)} accepts {_describe(accepted_kwargs(fn))}" for fn, n in by_fn.items())
    problems = []
    for key in unaccepted:
        others = [
            n for n in SCORERS.names() if n not in names and key in (accepted_kwargs(SCORERS.get(n)) or ())
        ]
        hint = f" (scorers of other data sources take it: {', '.join(others)})" if others else ""
        problems.append(f"reward kwarg {key!r} is accepted by no {scope}{hint}: {table}")
    return problems


def _accepts(fn: Callable, key: str) -> bool:
    accepted = accepted_kwargs(fn)
    return accepted is None or key in accepted


def kwargs_for_scorer(scorer: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The part of ``kwargs`` that ``scorer`` accepts; :class:`ScoreKwargsError` when some keyword is
    accepted by no registered scorer (it would otherwise be dropped on every row)."""
    accepted = accepted_kwargs(scorer)
    if accepted is None or kwargs.keys() <= accepted:
        return kwargs
    problems = score_kwargs_problems([k for k in kwargs if k not in accepted])
    if problems:
        raise ScoreKwargsError("; ".join(problems))
    return {key: value for key, value in kwargs.items() if key in accepted}


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs
) -> float | dict:
    """Score ``solution_str`` with the scorer registered for ``data_source``.

    ``kwargs`` reach the scorer only where its signature takes them (:func:`kwargs_for_scorer`).
    Numbers (and bools) come back as ``float``; dicts are returned as they are and must hold ``"score"``.
    An unknown ``data_source`` raises an error listing the registered ones.
    """
    scorer = SCORERS.get(data_source)
    kwargs = kwargs_for_scorer(scorer, kwargs) if kwargs else kwargs
    result = scorer(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"scorer for {data_source!r} returned a dict without 'score': {sorted(result)}")
        return result
    return float(result)


__all__ = [
    "SCORERS",
    "ScoreFn",
    "ScoreKwargsError",
    "accepted_kwargs",
    "default_compute_score",
    "kwargs_for_scorer",
    "register_scorer",
    "score_kwargs_problems",
]
