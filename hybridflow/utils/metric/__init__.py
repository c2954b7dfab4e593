"""Metric containers and reduction (verl's ``verl.utils.metric``): :class:`Metric` collects values
and aggregates them by its :class:`AggregationType`; :func:`reduce_metrics` reduces a dict of them."""

from hybridflow.utils.metric.utils import AggregationType, Metric, reduce_metrics

__all__ = ["AggregationType", "Metric", "reduce_metrics"]
