"""Rule-based reward scorers, dispatched by ``data_source`` as verl's ``default_compute_score`` does.

verl's table (``verl/utils/reward_score/__init__.py``), each row a module of this package:

* ``openai/gsm8k`` -> :mod:`.gsm8k`; ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
  ``HuggingFaceH4/MATH-500`` -> :mod:`.math` (Math-Verify with ``use_math_verify=True``);
* ``math_dapo``, ``math``, ``math_dapo_reasoning`` and every ``aime*`` -> :mod:`.math_dapo`;
* ``numina_aops_forum``, ``numina_synthetic_math``, ``numina_amc_aime``, ``numina_synthetic_amc``,
  ``numina_cn_k12``, ``numina_olympiads`` -> :mod:`.prime_math`;
* ``codecontests``, ``apps``, ``codeforces``, ``taco`` -> :mod:`.sandbox_fusion` when a
  ``sandbox_fusion_url`` is given, else :mod:`.prime_code` (the test cases run in the local sandbox);
* ``hiyouga/geometry3k`` -> :mod:`.geo3k`;
* ``searchR1_nq``, ``searchR1_triviaqa``, ``searchR1_popqa``, ``searchR1_hotpotqa``,
  ``searchR1_2wikimultihopqa``, ``searchR1_musique``, ``searchR1_bamboogle`` -> :mod:`.search_r1_like_qa_em`;
* beyond verl: ``hybridflow/arithmetic`` -> :mod:`.arithmetic`.

Each module's own ``compute_score`` keeps verl's signature (``gsm8k.compute_score(solution_str,
ground_truth, method=...)``); what is registered here has verl's custom-reward signature::

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

A dict result carries the reward under ``"score"`` plus extra fields the reward manager logs. Add a
scorer by decorating it with ``@register_scorer("my/data_source", "alias", ...)`` (or
``@register_scorer_prefix("family_")``); the dispatcher never special-cases an entry.

Extra keyword arguments (``reward_model.reward_kwargs``, and the SandboxFusion settings verl passes:
``sandbox_fusion_url``, ``concurrent_semaphore``, ``memory_limit_mb``) reach each scorer only if its
signature names them (a scorer with ``**kwargs`` takes them all), so ``use_math_verify=True`` on a run
mixing MATH and gsm8k rows reaches the MATH rows only. A keyword no scorer takes is an error
(:class:`ScoreKwargsError`), never silently dropped; :func:`score_kwargs_problems` reports it at
start-up for the data sources of a run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

# The built-in scorers register themselves into SCORERS on import.
from hybridflow.utils.registry import RegistryError
from hybridflow.utils.reward_score import (  # noqa: F401
    arithmetic,
    geo3k,
    gsm8k,
    math,
    math_dapo,
    prime_math,
    sandbox_fusion,
    search_r1_like_qa_em,
)
from hybridflow.utils.reward_score.registry import (
    SCORER_PREFIXES,
    SCORERS,
    ScoreFn,
    register_scorer,
    register_scorer_prefix,
    scorer_for,
)

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
    for name in names:
        try:
            by_fn.setdefault(scorer_for(name), []).append(name)
        except RegistryError:  # the dispatcher reports it, listing the registered names
            continue
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
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    sandbox_fusion_url: str | None = None,
    concurrent_semaphore: Any = None,
    memory_limit_mb: int | None = None,
    **kwargs,
) -> float | dict:
    """Score ``solution_str`` with the scorer registered for ``data_source`` (verl's signature).

    The SandboxFusion settings, when given, and ``kwargs`` reach the scorer only where its signature
    takes them (:func:`kwargs_for_scorer`). As in verl, numbers (and bools) come back as ``float``, a
    tuple as ``float`` of its first item, and dicts as they are (they must hold ``"score"``). An unknown
    ``data_source`` raises an error listing the registered ones.
    """
    scorer = scorer_for(data_source)
    sandbox = {"sandbox_fusion_url": sandbox_fusion_url, "concurrent_semaphore": concurrent_semaphore}
    sandbox["memory_limit_mb"] = memory_limit_mb
    kwargs = {**{k: v for k, v in sandbox.items() if v is not None}, **kwargs}
    kwargs = kwargs_for_scorer(scorer, kwargs) if kwargs else kwargs
    result = scorer(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"scorer for {data_source!r} returned a dict without 'score': {sorted(result)}")
        return result
    if isinstance(result, tuple | list):  # verl: (score, metadata) from the code scorers
        return float(result[0])
    return float(result)


__all__ = [
    "SCORERS",
    "SCORER_PREFIXES",
    "ScoreFn",
    "ScoreKwargsError",
    "accepted_kwargs",
    "default_compute_score",
    "kwargs_for_scorer",
    "register_scorer",
    "register_scorer_prefix",
    "score_kwargs_problems",
    "scorer_for",
]
