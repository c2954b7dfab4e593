"""The scorer registry, apart from the dispatcher in :mod:`hybridflow.utils.reward_score`: the built-in
scorer modules register into it without importing the package that imports them."""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.utils.registry import Registry

ScoreFn = Callable[..., float | dict]

SCORERS: Registry[ScoreFn] = Registry("reward scorer for data_source")


def register_scorer(data_source: str, *aliases: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator: score rows whose ``data_source`` is ``data_source`` or one of ``aliases``."""
    return SCORERS.register(data_source, *aliases)
