"""verl's ``union_tensor_dict`` / ``union_numpy_dict``: merge two containers of the same rows, refusing
a shared key whose values differ. Re-exported by :mod:`hybridflow.protocol` (verl's import path)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from hybridflow.errors import DataProtoError

__all__ = ["UnionConflictError", "union_numpy_dict", "union_tensor_dict"]


def _values_equal(x: Any, y: Any) -> bool:
    """Loose equality for meta_info values (numpy arrays and tensors compared element-wise)."""
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return bool(np.array_equal(x, y))
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return bool(torch.equal(torch.as_tensor(x), torch.as_tensor(y)))
    return x == y


class UnionConflictError(DataProtoError):
    """Two containers disagree on a shared key. A ``ValueError``, and an ``AssertionError`` because
    verl's ``union_*`` helpers assert (code written against verl catches that)."""


def _deep_equal(a: Any, b: Any, seen: set[tuple[int, int]] | None = None) -> bool:
    """verl's strict equality for non-tensor values: same type, NaN equals NaN, numpy arrays need the
    same dtype and shape, object arrays/lists/dicts compare element by element.

    Containers that contain themselves compare without recursing forever: a pair of containers met
    again while it is being compared counts as equal (two self-referencing arrays of the same shape
    are equal; a self-referencing one and a plain one still differ at the first element)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if not isinstance(a, np.ndarray | list | tuple | dict):
        return bool(a == b)
    if isinstance(a, np.ndarray) and a.dtype != object:
        same_layout = a.dtype == b.dtype and a.shape == b.shape
        return same_layout and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    seen = set() if seen is None else seen
    pair = (id(a), id(b))
    if pair in seen:
        return True
    seen.add(pair)
    try:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(_deep_equal(a[k], b[k], seen) for k in a)
        if isinstance(a, np.ndarray):
            if a.shape != b.shape:
                return False
            a, b = a.flat, b.flat
        elif len(a) != len(b):
            return False
        return all(_deep_equal(x, y, seen) for x, y in zip(a, b, strict=True))
    finally:
        seen.discard(pair)


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s keys to ``tensor_dict1`` in place and return it (verl's helper).

    Batch sizes must match and a key present in both must hold equal tensors; otherwise
    :class:`UnionConflictError` is raised before anything is written."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise UnionConflictError(
            f"union: batch sizes differ ({list(tensor_dict1.batch_size)} vs {list(tensor_dict2.batch_size)})"
        )
    for key in tensor_dict2.keys():
        if key in tensor_dict1.keys() and not _td_values_equal(tensor_dict1.get(key), tensor_dict2.get(key)):
            raise UnionConflictError(f"union: batch key {key!r} differs between the two TensorDicts")
    for key in tensor_dict2.keys():
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = tensor_dict2.get(key)  # .get keeps NonTensorData wrapped
    return tensor_dict1


def _td_values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return _values_equal(a, b)


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict:
    """Add ``tensor_dict2``'s arrays to ``tensor_dict1`` in place and return it (verl's helper).

    A key present in both must hold numpy arrays equal under verl's rules (same dtype and shape,
    NaN == NaN, object elements compared recursively); otherwise :class:`UnionConflictError`."""
    for key, value in tensor_dict2.items():
        if key not in tensor_dict1:
            continue
        mine = tensor_dict1[key]
        if not isinstance(mine, np.ndarray) or not isinstance(value, np.ndarray):
            raise UnionConflictError(
                f"union: non_tensor_batch key {key!r} must be a numpy array on both sides"
            )
        if not _deep_equal(mine, value):
            raise UnionConflictError(
                f"union: non_tensor_batch key {key!r} differs: "
                f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object."
            )
    tensor_dict1.update(tensor_dict2)
    return tensor_dict1
