"""The scorer registry, apart from the dispatcher in :mod:`hybridflow.utils.reward_score`: the built-in
scorer modules register into it without importing the package that imports them.

A scorer is registered under exact ``data_source`` names (:func:`register_scorer`) or, where verl
matches a family by its start (``aime2024``, ``aime_2025``... all go to ``math_dapo``), under a prefix
(:func:`register_scorer_prefix`). :func:`scorer_for` looks a name up: an exact entry first, then the
longest registered prefix; one rule for every entry.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.utils.registry import Registry, RegistryError

ScoreFn = Callable[..., float | dict]

SCORERS: Registry[ScoreFn] = Registry("reward scorer for data_source")
SCORER_PREFIXES: Registry[ScoreFn] = Registry("reward scorer for data_source prefix")


def register_scorer(data_source: str, *aliases: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator: score rows whose ``data_source`` is ``data_source`` or one of ``aliases``."""
    return SCORERS.register(data_source, *aliases)


def register_scorer_prefix(prefix: str, *prefixes: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator: score rows whose ``data_source`` starts with ``prefix`` (or one of ``prefixes``) and
    that no exact entry claims."""
    return SCORER_PREFIXES.register(prefix, *prefixes)


def scorer_for(data_source: str, default: ScoreFn | None = None) -> ScoreFn:
    """The scorer of ``data_source``: its exact entry, else the longest matching prefix entry; unknown:
    ``default`` when given, else ``RegistryError`` listing the registered names and prefixes."""
    exact = SCORERS.get(data_source, None)
    if exact is not None:
        return exact
    matches = [p for p in SCORER_PREFIXES.names() if str(data_source).startswith(p)]
    if matches:
        return SCORER_PREFIXES.get(max(matches, key=len))
    if default is not None:
        return default
    prefixes = ", ".join(f"{p}*" for p in SCORER_PREFIXES.names())
    raise RegistryError(
        f"Unknown reward scorer for data_source {data_source!r}. Registered: {', '.join(SCORERS.names())}"
        f"; prefixes: {prefixes or 'none'}"
    )
