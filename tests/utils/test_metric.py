"""hybridflow.utils.metric: verl's Metric/AggregationType and reduce_metrics with Metric values."""

import math

import numpy as np
import pytest
import torch

from hybridflow.utils.metric import AggregationType, Metric, reduce_metrics


def test_each_rule_by_hand():
    values = [3.0, 1.0, 4.0, 2.0]
    expected = {"mean": 2.5, "sum": 10.0, "min": 1.0, "max": 4.0}  # (3 + 1 + 4 + 2) / 4 = 2.5
    for rule, result in expected.items():
        metric = Metric(rule, values)
        assert metric.aggregation is AggregationType(rule) and metric.aggregate() == result


def test_values_in_and_errors():
    metric = Metric(AggregationType.SUM, 1)
    metric.append(torch.tensor(2.0))  # one-element tensor -> its number
    metric.append(np.float32(0.5))
    metric.append(Metric("sum", [0.25]))
    assert metric.values == [1, 2.0, 0.5, 0.25] and metric.aggregate() == 3.75
    with pytest.raises(ValueError):
        Metric("median")
    with pytest.raises(ValueError):
        metric.append(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError):
        metric.append("3")
    with pytest.raises(ValueError, match="cannot merge a mean metric into a sum one"):
        metric.extend(Metric("mean", 1.0))


def test_chain_from_dict_init_list_and_empty():
    chained = Metric.chain([Metric("max", [1, 5]), Metric("max", [3])])
    assert chained.values == [1, 5, 3] and chained.aggregate() == 5
    assert Metric.chain([]).aggregation is AggregationType.MEAN
    made = Metric.from_dict({"loss": 0.5, "n": 2}, aggregation="sum")
    assert made["loss"].values == [0.5] and made["n"].aggregation is AggregationType.SUM
    assert chained.init_list().values == [] and chained.init_list().aggregation is AggregationType.MAX
    assert math.isnan(Metric("mean").aggregate()) and Metric("sum").aggregate() == 0.0


def test_reduce_metrics_mixes_metrics_and_lists_without_touching_the_input():
    metrics = {"tokens": Metric("sum", [100, 200]), "loss": [1.0, 3.0], "grad/max_norm": [1.0, 3.0]}
    assert reduce_metrics(metrics) == {"tokens": 300.0, "loss": 2.0, "grad/max_norm": 3.0}
    assert isinstance(metrics["tokens"], Metric)
