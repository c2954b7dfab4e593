"""A value collector that knows how to aggregate itself, and the reduction of a step's metrics.

Workers report metrics per micro-batch or per rank; the controller reduces each key to one number.
A plain list is reduced by its key's name (mean, or max/min when the key says so); a :class:`Metric`
carries its own :class:`AggregationType` (mean, sum, min, max), so a count can be summed across
ranks while a loss is averaged. Names and behaviour follow verl's ``verl.utils.metric.utils``.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from enum import Enum
from typing import Any

import numpy as np

__all__ = ["AggregationType", "Metric", "reduce_metrics"]


class AggregationType(Enum):
    """How a :class:`Metric`'s values become one number."""

    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_AGGREGATE = {
    AggregationType.MEAN: np.mean,
    AggregationType.SUM: np.sum,
    AggregationType.MIN: np.min,
    AggregationType.MAX: np.max,
}


def _scalar(value: Any) -> float | int:
    """A plain number from an int/float/numpy scalar or a one-element tensor or array."""
    if hasattr(value, "numel") or isinstance(value, np.ndarray):  # torch.Tensor or numpy array
        size = value.numel() if hasattr(value, "numel") else value.size
        if size != 1:
            raise ValueError(f"only a one-element tensor can be a metric value, got {size} elements")
        return value.item()
    if isinstance(value, numbers.Real):
        return value
    raise ValueError(f"a metric value must be a number or a scalar tensor, got {type(value).__name__}")


class Metric:
    """Values of one metric plus the rule that aggregates them.

    ``Metric("mean", 1.0)`` starts with ``[1.0]``; ``append`` adds a number, a one-element tensor (as
    its Python number) or another Metric's values; ``aggregate()`` applies the rule:
    ``Metric("sum", [1, 2, 3]).aggregate() == 6``. An unknown rule or value is a ``ValueError``.
    """

    def __init__(self, aggregation: str | AggregationType, value: Any = None) -> None:
        self.aggregation = AggregationType(aggregation)  # ValueError for an unknown name
        self.values: list[float | int] = []
        if isinstance(value, list | tuple):
            self.extend(value)
        elif value is not None:
            self.append(value)

    def append(self, value: Any) -> None:
        """Add one value, or every value of another Metric (its rule must match)."""
        if isinstance(value, Metric):
            self.extend(value)
        else:
            self.values.append(_scalar(value))

    def extend(self, values: Metric | Iterable[Any]) -> None:
        """Add many values: an iterable of numbers, or a Metric with the same aggregation."""
        if isinstance(values, Metric):
            if values.aggregation != self.aggregation:
                raise ValueError(
                    f"cannot merge a {values.aggregation.value} metric into a {self.aggregation.value} one"
                )
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self) -> float:
        """The values reduced by the rule; NaN for mean/min/max of no values, 0 for their sum."""
        if not self.values:
            return 0.0 if self.aggregation is AggregationType.SUM else float("nan")
        return _AGGREGATE[self.aggregation](self.values)

    @classmethod
    def chain(cls, metric_lists: list[Metric]) -> Metric:
        """One Metric holding the values of all, in order, with the first one's rule (mean if none)."""
        if not metric_lists:
            return cls(AggregationType.MEAN)
        chained = cls(metric_lists[0].aggregation)
        for metric in metric_lists:
            chained.extend(metric)
        return chained

    @classmethod
    def from_dict(cls, data: dict[str, Any], aggregation: str | AggregationType) -> dict[str, Metric]:
        """``{name: value}`` -> ``{name: Metric(aggregation, value)}``."""
        return {key: cls(aggregation, value) for key, value in data.items()}

    def init_list(self) -> Metric:
        """An empty Metric with the same rule."""
        return Metric(self.aggregation)

    def __repr__(self) -> str:
        return f"Metric({self.aggregation.value!r}, {self.values!r})"


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Reduce each entry (one value per micro-batch or rank) to one number, as verl does.

    A :class:`Metric` aggregates by its own rule. A list reduces by its key: a ``max`` (or ``min``)
    path/underscore token takes the max (min), e.g. ``perf/max_memory_allocated_gb``; everything else
    the mean. An empty list reduces to NaN (verl's ``np.mean([])``); scalars and 0-d tensors pass
    through. Returns a new dict (the input is not modified). verl matches plain substrings, so its
    ``timing_s/...`` (t-i-*min*-g) reduces by min; matching whole tokens avoids that.
    """
    reduced = {}
    for key, value in metrics.items():
        if isinstance(value, Metric):
            reduced[key] = float(value.aggregate())
            continue
        if hasattr(value, "reshape") and hasattr(value, "ndim"):  # torch.Tensor or numpy array
            value = value.reshape(-1).tolist() if value.ndim > 0 else value.item()
        if not isinstance(value, list | tuple):
            reduced[key] = float(value)
            continue
        values = np.asarray([float(v) for v in value], dtype=np.float64)
        tokens = set(key.replace("/", "_").split("_"))
        if values.size == 0:
            reduced[key] = float("nan")
        elif "max" in tokens:
            reduced[key] = float(values.max())
        elif "min" in tokens:
            reduced[key] = float(values.min())
        else:
            reduced[key] = float(values.mean())
    return reduced
