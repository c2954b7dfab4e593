"""Whole-batch reshaping helpers of verl's ``protocol`` module, on any DataProto (re-exported by
:mod:`hybridflow.protocol`, verl's import path).

- :func:`fold_batch_dim` / :func:`unfold_batch_dim`: ``B`` rows <-> ``(G, B // G)`` groups;
- :func:`pad_dataproto_to_divisor` / :func:`unpad_dataproto`: cycle rows until ``B`` divides a size;
- :func:`unfold_column_chunks`: split the second dim of chosen keys into ``n`` rows each.

Each function takes the DataProto (or subclass) and returns a new one of the same type that owns a
copy of ``meta_info``; none imports :mod:`hybridflow.protocol` (no import cycle).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.errors import DataProtoError

# A hybridflow.protocol.DataProto (or subclass); not imported, since protocol sits above this module.
DataProto = Any

__all__ = [
    "fold_batch_dim",
    "pad_dataproto_to_divisor",
    "unfold_batch_dim",
    "unfold_column_chunks",
    "unpad_dataproto",
]


def _rebuild(data: DataProto, batch, non_tensor: dict) -> DataProto:
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=copy.deepcopy(data.meta_info))


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """``(B, ...)`` rows → ``new_batch_size`` rows of ``(B // new_batch_size, ...)`` (verl's helper).

    Tensors ``(B, *s)`` become ``(new_batch_size, B // new_batch_size, *s)`` and non-tensor arrays
    likewise; ``data`` is left unchanged."""
    n = len(data)
    if new_batch_size <= 0 or n % new_batch_size:
        raise DataProtoError(f"fold_batch_dim: a batch of {n} does not fold into {new_batch_size} rows")
    batch = None
    if data.batch is not None:
        batch = data.batch.view(new_batch_size, -1)
        batch.auto_batch_size_(batch_dims=1)
    non_tensor = {
        k: np.reshape(v, (new_batch_size, -1, *v.shape[1:])) for k, v in data.non_tensor_batch.items()
    }
    return _rebuild(data, batch, non_tensor)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Inverse of :func:`fold_batch_dim`: merge the first ``batch_dims`` dims into one batch dim."""
    batch = None
    if data.batch is not None:
        batch = data.batch.copy()  # shallow: auto_batch_size_ must not touch the caller's TensorDict
        batch.auto_batch_size_(batch_dims=batch_dims)
        batch = batch.view(-1)
        n = int(batch.batch_size[0])
    else:
        first = next(iter(data.non_tensor_batch.values()), np.empty((0,) * batch_dims))
        n = int(np.prod(first.shape[:batch_dims]))
    non_tensor = {k: np.reshape(v, (n, *v.shape[batch_dims:])) for k, v in data.non_tensor_batch.items()}
    return _rebuild(data, batch, non_tensor)


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` by cycling its own rows until its length divides ``size_divisor``.

    Returns ``(padded, pad_size)``; undo with :func:`unpad_dataproto`. E.g. rows ``[a, b, c]`` with
    divisor 7 become ``[a, b, c, a, b, c, a]`` and ``pad_size`` 4."""
    if size_divisor <= 0:
        raise DataProtoError(f"size_divisor must be positive, got {size_divisor}")
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0:
        return data, 0
    if n == 0:
        raise DataProtoError("cannot pad an empty DataProto")
    repeats = math.ceil(pad_size / n)
    filler = data.select(meta_info_keys=[]).repeat(repeats, interleave=False).slice(0, pad_size)
    padded = type(data).concat([data.select(meta_info_keys=[]), filler])
    padded.meta_info = copy.deepcopy(data.meta_info)
    return padded, pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows added by :func:`pad_dataproto_to_divisor`."""
    return data.slice(0, len(data) - pad_size) if pad_size else data


def unfold_column_chunks(data: DataProto, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
    """Each row becomes ``n_split`` rows (verl's ``DataProto.unfold_column_chunks``).

    A key in ``split_keys`` (tensor ``(B, C, *s)`` or non-tensor array ``(B, C, ...)``) has its second
    dim cut into ``n_split`` consecutive chunks: ``(B * n_split, C // n_split, *s)``, chunk ``j`` of
    row ``i`` landing at row ``i * n_split + j``. Every other key is repeated ``n_split`` times in
    place (``[a, a, b, b]``). E.g. ``obs1 = [[1, 2, 3, 4]]`` split in 2 gives ``[[1, 2], [3, 4]]`` and
    ``obs2 = [[1, 2]]`` (not split) gives ``[[1, 2], [1, 2]]``. ``C`` must divide by ``n_split``."""
    split = set(split_keys or ())
    batch = None
    if data.batch is not None:
        from tensordict import TensorDict

        columns = {
            key: _cut(value, n_split, key) if key in split else value.repeat_interleave(n_split, dim=0)
            for key, value in data.batch.items()
        }
        size = (len(data) * n_split,)
        batch = TensorDict(columns, batch_size=size, device=data.batch.device)
    non_tensor = {
        key: _cut(value, n_split, key) if key in split else np.repeat(value, n_split, axis=0)
        for key, value in data.non_tensor_batch.items()
    }
    return _rebuild(data, batch, non_tensor)


def _cut(value: torch.Tensor | np.ndarray, n_split: int, key: str):
    """``(B, C, *s)`` -> ``(B * n_split, C // n_split, *s)`` (rows of one input row stay together)."""
    if value.ndim < 2 or value.shape[1] % n_split:
        raise DataProtoError(
            f"unfold_column_chunks: {key!r} of shape {tuple(value.shape)} "
            f"has no second dim divisible by {n_split}"
        )
    return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])
