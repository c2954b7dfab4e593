"""Helpers for a TensorDict that carries everything of a batch (verl's ``tensordict_utils``).

In this layout one ``TensorDict`` with ``batch_size=[B]`` holds:

- tensors ``(B, ...)``, possibly jagged nested tensors (rows of different lengths);
- per-row Python values as a ``NonTensorStack`` of ``B`` items (strings, lists, dicts);
- batch-level values as ``NonTensorData`` (one value for the whole batch, like ``meta_info``).

:meth:`hybridflow.protocol.DataProto.to_tensordict` produces it and ``from_tensordict`` reads it back.
The functions keep verl's names and signatures; a refused input raises
:class:`hybridflow.errors.InvalidInputError` (a ValueError and an AssertionError, as verl asserts).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from hybridflow.errors import InvalidInputError
from hybridflow.protocol_union import union_tensor_dict

__all__ = [
    "assert_tensordict_eq",
    "assign_non_tensor",
    "assign_non_tensor_data",
    "assign_non_tensor_stack",
    "chunk_tensordict",
    "concat_nested_tensors",
    "concat_tensordict",
    "contiguous",
    "get",
    "get_keys",
    "get_non_tensor_data",
    "get_tensordict",
    "index_select_tensor_dict",
    "make_iterator",
    "pad_to_divisor",
    "pop",
    "pop_keys",
    "union_tensor_dict",
    "unpad",
    "unwrap_non_tensor_data",
]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidInputError(message)


def _stack(values: list) -> NonTensorStack:
    """``B`` Python values as one NonTensorStack; each value (even a list or dict) stays one item."""
    for value in values:
        _check(not isinstance(value, torch.Tensor), "a list column cannot hold torch tensors; use numpy")
    return NonTensorStack.from_list([NonTensorData(value) for value in values])


def _is_nested(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_nested


# ----------------------------------------------------------------------------- building and reading


def get_tensordict(
    tensor_dict: dict[str, torch.Tensor | list], non_tensor_dict: dict | None = None
) -> TensorDict:
    """One TensorDict from per-row columns and batch-level values.

    ``tensor_dict``: tensors ``(B, ...)`` (jagged nested tensors allowed) or lists of ``B`` Python
    values (become a NonTensorStack, nested lists/dicts kept whole); all must have the same ``B``.
    ``non_tensor_dict``: batch-level values, stored as NonTensorData. With no columns the TensorDict
    has an empty batch size. E.g. ``get_tensordict({"obs": torch.zeros(3, 4), "turns": [[], [1],
    [2, 3]]}, {"step": 7})`` has ``batch_size == [3]``."""
    source: dict[str, Any] = {}
    batch = None
    for key, value in tensor_dict.items():
        if _is_nested(value):
            _check(value.layout == torch.jagged, f"nested tensor {key!r} must use layout=torch.jagged")
        if isinstance(value, list):
            value = _stack(value)
        _check(
            isinstance(value, torch.Tensor | NonTensorStack),
            f"column {key!r} must be a tensor or a list, got {type(value).__name__}",
        )
        rows = value.size(0) if isinstance(value, torch.Tensor) else len(value)
        _check(batch is None or rows == batch, f"column {key!r} has {rows} rows, others have {batch}")
        batch, source[key] = rows, value
    for key, value in (non_tensor_dict or {}).items():
        _check(key not in source, f"key {key!r} is both a column and a batch-level value")
        source[key] = NonTensorData(value)
    return TensorDict(source, batch_size=[] if batch is None else [batch])


def assign_non_tensor_data(tensor_dict: TensorDict, key: str, val: Any) -> None:
    """Store one batch-level value under ``key`` (as NonTensorData)."""
    _check(isinstance(tensor_dict, TensorDict), "input must be a TensorDict")
    tensor_dict[key] = NonTensorData(val)


def assign_non_tensor_stack(tensor_dict: TensorDict, key: str, val: list) -> None:
    """Store a per-row list under ``key`` (as a NonTensorStack; nested lists/dicts stay whole)."""
    _check(isinstance(tensor_dict, TensorDict), "input must be a TensorDict")
    tensor_dict[key] = _stack(list(val))


def assign_non_tensor(tensor_dict: TensorDict, **kwargs) -> TensorDict:
    """Store each keyword: a list as a per-row stack, anything else as one batch-level value."""
    _check(isinstance(tensor_dict, TensorDict), "input must be a TensorDict")
    for key, value in kwargs.items():
        if isinstance(value, NonTensorData | NonTensorStack):
            tensor_dict[key] = value
        elif isinstance(value, list):
            assign_non_tensor_stack(tensor_dict, key, value)
        else:
            assign_non_tensor_data(tensor_dict, key, value)
    return tensor_dict


def unwrap_non_tensor_data(data: Any) -> Any:
    """The value inside a NonTensorData; anything else unchanged."""
    return data.data if isinstance(data, NonTensorData) else data


def get_non_tensor_data(data: TensorDict, key: str, default: Any) -> Any:
    """``data[key]`` unwrapped from NonTensorData, or ``default`` when absent."""
    return unwrap_non_tensor_data(data.get(key, default))


def _plain(value: Any) -> Any:
    """A stored value in Python form: tensors as they are, a stack as a list, data unwrapped."""
    if isinstance(value, torch.Tensor) and not isinstance(value, NonTensorData | NonTensorStack):
        return value
    if isinstance(value, NonTensorStack):
        return value.tolist()
    return unwrap_non_tensor_data(value)


def get(tensordict: TensorDict, key: str, default: Any = None) -> Any:
    """``tensordict[key]`` in Python form (tensor, list for a per-row stack, value), or ``default``."""
    return _plain(tensordict.get(key)) if key in tensordict.keys() else default


def pop(tensordict: TensorDict, key: str, default: Any = None) -> Any:
    """Like :func:`get`, and removes ``key`` from ``tensordict``."""
    return _plain(tensordict.pop(key)) if key in tensordict.keys() else default


def _subset(tensordict: TensorDict, keys: Iterable[str], remove: bool) -> TensorDict:
    columns, scalars = {}, {}
    for key in keys:
        _check(key in tensordict.keys(), f"key {key!r} is not in the TensorDict")
        value = tensordict.pop(key) if remove else tensordict.get(key)
        if isinstance(value, NonTensorData):
            scalars[key] = value.data
        else:
            columns[key] = value.tolist() if isinstance(value, NonTensorStack) else value
    return get_tensordict(columns, scalars)


def get_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """A new TensorDict with only ``keys`` (each must exist)."""
    return _subset(tensordict, keys, remove=False)


def pop_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """Remove ``keys`` from ``tensordict`` and return them as a new TensorDict."""
    return _subset(tensordict, keys, remove=True)


# ----------------------------------------------------------------------------- rows


def index_select_tensor_dict(
    batch: TensorDict | None, indices: torch.Tensor | list[int]
) -> TensorDict | None:
    """Rows ``indices`` (1-D) of ``batch``: tensors indexed, jagged tensors re-packed row by row,
    per-row stacks indexed, batch-level values kept. ``None`` stays ``None``."""
    indices = torch.as_tensor(indices, dtype=torch.long)
    _check(indices.dim() == 1, f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if batch is None:
        return None
    rows: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, NonTensorData):
            rows[key] = value
        elif _is_nested(value):
            unbound = value.unbind()
            rows[key] = torch.nested.as_nested_tensor([unbound[i] for i in indices], layout=torch.jagged)
        else:
            rows[key] = value[indices]
    return TensorDict(rows, batch_size=[len(indices)])


def concat_nested_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Jagged tensors ``(B_i, j1, ...)`` joined along rows into one jagged tensor."""
    rows: list[torch.Tensor] = []
    for tensor in tensors:
        _check(_is_nested(tensor) and tensor.dim() >= 2, f"expected a nested tensor, got {tensor.shape}")
        rows.extend(tensor.unbind(0))
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def concat_tensordict(data: list[TensorDict]) -> TensorDict:
    """TensorDicts joined along rows (jagged tensors included). TensorDicts without a batch dim
    (batch-level values only) are not concatenated: the first one is returned."""
    _check(len(data) > 0, "concat_tensordict: nothing to concatenate")
    if len(data[0].batch_size) == 0:
        _check(all(len(d.batch_size) == 0 for d in data), "cannot mix batched and unbatched TensorDicts")
        return data[0]
    nested = {k for k, v in data[0].items() if _is_nested(v)}
    for td in data:
        _check({k for k, v in td.items() if _is_nested(v)} == nested, "parts differ in their nested keys")
    plain = [
        TensorDict({k: v for k, v in td.items() if k not in nested}, batch_size=td.batch_size) for td in data
    ]
    out = TensorDict.cat(plain, dim=0)
    for key in nested:
        out[key] = concat_nested_tensors([td[key] for td in data])
    return out


def chunk_tensordict(td: TensorDict, chunks: int) -> list[TensorDict]:
    """``chunks`` equal parts along rows (``len(td)`` must divide), jagged tensors included."""
    _check(
        isinstance(td, TensorDict) and chunks > 0 and len(td) % chunks == 0,
        f"a TensorDict of {len(td)} rows does not split into {chunks} equal chunks",
    )
    size = len(td) // chunks
    return [index_select_tensor_dict(td, torch.arange(i * size, (i + 1) * size)) for i in range(chunks)]


def pad_to_divisor(data: TensorDict, size_divisor: int) -> tuple[TensorDict, int]:
    """Append rows from the start (cycling) until ``len(data)`` divides ``size_divisor``;
    returns ``(padded, pad_size)``. E.g. rows ``[a, b, c]``, divisor 4 → ``[a, b, c, a]``, 1."""
    _check(size_divisor > 0, f"size_divisor must be positive, got {size_divisor}")
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0:
        return data, 0
    _check(n > 0, "cannot pad an empty TensorDict")
    order = torch.cat([torch.arange(n), torch.arange(pad_size) % n])
    return index_select_tensor_dict(data, order), pad_size


def unpad(data: TensorDict, pad_size: int) -> TensorDict:
    """Drop the last ``pad_size`` rows added by :func:`pad_to_divisor`."""
    return index_select_tensor_dict(data, torch.arange(len(data) - pad_size)) if pad_size else data


def contiguous(data: TensorDict) -> TensorDict:
    """Every tensor made contiguous (jagged ones included); other values unchanged."""
    out = {
        k: v.contiguous()
        if isinstance(v, torch.Tensor) and not isinstance(v, NonTensorData | NonTensorStack)
        else v
        for k, v in data.items()
    }
    return TensorDict(out, batch_size=data.batch_size, device=data.device)


def make_iterator(
    tensordict: TensorDict, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs=None
) -> Iterator[TensorDict]:
    """Mini-batches of ``mini_batch_size`` rows, ``epochs`` passes; ``dataloader_kwargs={"shuffle":
    True}`` draws a fresh order per pass from a generator seeded with ``seed`` (reproducible)."""
    n = len(tensordict)
    _check(
        mini_batch_size > 0 and n % mini_batch_size == 0, f"{n} rows are not divisible by {mini_batch_size}"
    )
    shuffle = bool((dataloader_kwargs or {}).get("shuffle", False))
    generator = torch.Generator()
    generator.manual_seed(0 if seed is None else seed)
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        for start in range(0, n, mini_batch_size):
            yield index_select_tensor_dict(tensordict, order[start : start + mini_batch_size])


def assert_tensordict_eq(tensordict1: TensorDict, tensordict2: TensorDict) -> None:
    """Raise unless both hold the same keys with equal values (jagged tensors row by row)."""
    _check(
        set(tensordict1.keys()) == set(tensordict2.keys()),
        f"key sets differ: {sorted(tensordict1.keys())} vs {sorted(tensordict2.keys())}",
    )
    for key in tensordict1.keys():
        a, b = tensordict1.get(key), tensordict2.get(key)
        _check(type(a) is type(b), f"{key!r}: {type(a).__name__} vs {type(b).__name__}")
        if isinstance(a, NonTensorData | NonTensorStack):
            _check(_plain(a) == _plain(b), f"{key!r} differs")
        elif _is_nested(a) or _is_nested(b):
            rows_a, rows_b = (a.unbind(), b.unbind()) if _is_nested(a) and _is_nested(b) else ((), (1,))
            _check(
                len(rows_a) == len(rows_b) and all(torch.equal(x, y) for x, y in zip(rows_a, rows_b)),
                f"{key!r} differs",
            )
        else:
            _check(a.shape == b.shape and torch.equal(a, b), f"{key!r} differs")
