"""DataProto: the one container passed between the single controller and the worker groups.

A ``DataProto`` holds three things about the same ``B`` rows:

- ``batch``: a ``tensordict.TensorDict`` with one batch dimension (``batch_size == [B]``); the
  standard keys and their shapes are declared in :mod:`hybridflow.keys`;
- ``non_tensor_batch``: ``dict[str, np.ndarray]`` of object arrays, each of length ``B``
  (strings, dicts, ragged lists: ``uid``, ``data_source``, ``reward_model``, ...);
- ``meta_info``: a plain dict of batch-level values (temperature, metrics, flags).

The semantics follow verl's DataProto so code written for verl ports over, with three deliberate
differences: operations never alias ``meta_info`` between their results (each result gets a
deep copy), pickling moves tensors as numpy buffers (fast through Ray's object store), and an
auto-padded ``chunk`` of an uneven batch gives every part ``B // n`` or ``B // n + 1`` rows. Refused
input raises :class:`DataProtoError`, both a ValueError and the AssertionError verl's asserts raise.
Whole-batch reshapes live in :mod:`hybridflow.protocol_ops`, serialisation in
:mod:`hybridflow.protocol_serde`, the union helpers in :mod:`hybridflow.protocol_union`.
"""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from hybridflow.errors import DataProtoError
from hybridflow.protocol_ops import (
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unfold_column_chunks,
    unpad_dataproto,
)
from hybridflow.protocol_serde import (
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
    tensordict_from_parts,
    tensordict_from_state,
    tensordict_to_parts,
    tensordict_to_state,
)
from hybridflow.protocol_union import (
    UnionConflictError,
    _values_equal,
    union_numpy_dict,
    union_tensor_dict,
)

__all__ = [
    "DataProto",
    "DataProtoError",
    "DataProtoItem",
    "DataProtoFuture",
    "UnionConflictError",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "pad_dataproto_to_divisor",
    "serialize_single_tensor",
    "serialize_tensordict",
    "unfold_batch_dim",
    "unfold_column_chunks",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]

AUTO_PADDING_KEY = "_auto_padding"


def _to_object_array(values: Any) -> np.ndarray:
    """A non-tensor column as verl stores it: a numpy array is kept as it is; any other sequence
    becomes ``np.array(values, dtype=object)``. So ragged rows stay one object per row (``(B,)``),
    while rows of equal-length lists become a ``(B, L)`` object array, as in verl."""
    if isinstance(values, np.ndarray):
        return values
    if isinstance(values, str | bytes | dict):
        raise DataProtoError(f"a non-tensor column must be a sequence of rows, got a {type(values).__name__}")
    return np.array(list(values), dtype=object)


def _merge_meta(base: dict, other: dict, where: str) -> dict:
    """Union of two meta_info dicts; a key present in both must hold equal values."""
    merged = copy.deepcopy(base)
    for key, value in other.items():
        if key in merged and not _values_equal(merged[key], value):
            raise DataProtoError(f"{where}: meta_info key {key!r} conflicts ({merged[key]!r} vs {value!r})")
        merged[key] = copy.deepcopy(value)
    return merged


def _list_of_dict_to_dict_of_list(dicts: list[dict]) -> dict[str, list]:
    out: dict[str, list] = {}
    for d in dicts:
        for key, value in d.items():
            out.setdefault(key, []).append(value)
    return out


@dataclass
class DataProtoItem:
    """One row of a DataProto: ``batch`` is a TensorDict with empty batch size."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass
class DataProto:
    """A batch of ``B`` rows: tensors, non-tensor numpy object arrays and batch-level meta info."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # verl accepts DataProto(non_tensor_batch=None) / meta_info=None: both mean "empty".
        self.non_tensor_batch = {} if self.non_tensor_batch is None else self.non_tensor_batch
        self.meta_info = {} if self.meta_info is None else self.meta_info
        self.check_consistency()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from tensors (all with the same leading ``num_batch_dims`` dims) and non-tensor
        sequences of that length (verl's signature). A DataProto has one batch dim, so
        ``num_batch_dims > 1`` only passes through here to be refused by :meth:`check_consistency`."""
        if num_batch_dims < 1:
            raise DataProtoError(f"from_dict: num_batch_dims must be >= 1, got {num_batch_dims}")
        if non_tensors and num_batch_dims != 1:
            raise DataProtoError("from_dict: non_tensors need num_batch_dims=1")
        tensors = tensors or {}
        non_tensors = {k: _to_object_array(v) for k, v in (non_tensors or {}).items()}
        batch = None
        if tensors:
            sizes = {k: tuple(v.shape[:num_batch_dims]) for k, v in tensors.items()}
            if len(set(sizes.values())) != 1:
                raise DataProtoError(f"DataProto.from_dict: tensors disagree on batch size: {sizes}")
            batch = TensorDict(dict(tensors), batch_size=list(next(iter(sizes.values()))))
        meta = copy.deepcopy(meta_info or {})
        if auto_padding:
            meta[AUTO_PADDING_KEY] = True
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Split one dict into tensors (``torch.Tensor`` values) and non-tensors (everything else)."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    # ------------------------------------------------------------------ basic protocol
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    def check_consistency(self) -> None:
        """Raise :class:`DataProtoError` unless the batch has one batch dim (verl's "only support
        num_batch_dims=1") and every field has ``len(self)`` rows."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise DataProtoError(
                f"DataProto.batch must have one batch dim (only num_batch_dims=1 is supported), "
                f"got batch_size {list(self.batch.batch_size)}"
            )
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise DataProtoError(f"non_tensor_batch[{key!r}] must be a numpy array, got {type(value)}")
        lengths = {k: len(v) for k, v in self.non_tensor_batch.items()}
        if self.batch is not None:
            lengths = {"<batch>": int(self.batch.batch_size[0]), **lengths}
        if len(set(lengths.values())) > 1:
            raise DataProtoError(f"DataProto fields disagree on length: {lengths}")

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """``int`` → DataProtoItem; ``slice`` → view-like DataProto; list/array/tensor/bool mask → copy."""
        if isinstance(item, (int, np.integer)):
            index = int(item)
            return DataProtoItem(
                batch=self.batch[index] if self.batch is not None else None,
                non_tensor_batch={k: v[index] for k, v in self.non_tensor_batch.items()},
                meta_info=copy.deepcopy(self.meta_info),
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"DataProto indices must be int, slice, list, array or tensor, not {type(item)}")

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step`` as a new DataProto (tensors are views, meta_info is copied)."""
        index = slice(start, end, step)
        return DataProto(
            batch=self.batch[index] if self.batch is not None else None,
            non_tensor_batch={k: v[index] for k, v in self.non_tensor_batch.items()},
            meta_info=copy.deepcopy(self.meta_info),
        )

    def select_idxs(self, idxs: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Rows chosen by an index list/array/tensor or a boolean mask of length ``len(self)``."""
        index = torch.as_tensor(np.asarray(idxs) if isinstance(idxs, list) else idxs)
        if index.dtype == torch.bool:
            if index.shape != (len(self),):
                raise DataProtoError(f"boolean mask of shape {tuple(index.shape)} for a batch of {len(self)}")
            index = index.nonzero(as_tuple=True)[0]
        index = index.long().reshape(-1)
        np_index = index.numpy()
        return DataProto(
            batch=self.batch[index] if self.batch is not None else None,
            non_tensor_batch={k: v[np_index] for k, v in self.non_tensor_batch.items()},
            meta_info=copy.deepcopy(self.meta_info),
        )

    # ------------------------------------------------------------------ key-level operations
    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto holding only the named keys (``None`` keeps every key of that kind)."""
        self._require_keys(batch_keys, non_tensor_batch_keys, meta_info_keys, "select")
        batch = self.batch
        if batch is not None and batch_keys is not None:
            batch = batch.select(*batch_keys)
        non_tensor = {
            k: v
            for k, v in self.non_tensor_batch.items()
            if non_tensor_batch_keys is None or k in non_tensor_batch_keys
        }
        meta = {k: v for k, v in self.meta_info.items() if meta_info_keys is None or k in meta_info_keys}
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensor = copy.deepcopy(non_tensor)
        return DataProto(batch=batch, non_tensor_batch=dict(non_tensor), meta_info=copy.deepcopy(meta))

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from ``self`` (in place) and return them as a new DataProto."""
        batch_keys, non_tensor_batch_keys, meta_info_keys = (
            list(batch_keys or []),
            list(non_tensor_batch_keys or []),
            list(meta_info_keys or []),
        )
        self._require_keys(batch_keys, non_tensor_batch_keys, meta_info_keys, "pop")
        tensors = {k: self.batch.pop(k) for k in batch_keys}
        non_tensors = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return DataProto.from_dict(tensors, non_tensors, meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename batch keys in place; returns ``self`` for chaining."""
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old_keys) != len(new_keys):
            raise DataProtoError(f"rename: {len(old_keys)} old keys but {len(new_keys)} new keys")
        self._require_keys(old_keys, None, None, "rename")
        for old, new in zip(old_keys, new_keys, strict=True):
            self.batch.rename_key_(old, new)
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other`` into ``self`` in place (:func:`union_tensor_dict`, :func:`union_numpy_dict`).

        Shared keys must hold equal values, else :class:`UnionConflictError` (a ValueError); every
        check runs before anything is written, so a failed union leaves ``self`` unchanged."""
        if len(self) and len(other) and len(self) != len(other):
            raise UnionConflictError(f"union: batch sizes differ ({len(self)} vs {len(other)})")
        meta = _merge_meta(self.meta_info, other.meta_info, "union")
        non_tensor = union_numpy_dict(dict(self.non_tensor_batch), other.non_tensor_batch)
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch.clone(recurse=False)
            else:
                union_tensor_dict(self.batch, other.batch)
        self.non_tensor_batch.update(non_tensor)
        self.meta_info = meta
        return self

    def _require_keys(self, batch_keys, non_tensor_keys, meta_keys, op: str) -> None:
        present = set(self.batch.keys()) if self.batch is not None else set()
        for wanted, have, kind in (
            (batch_keys, present, "batch"),
            (non_tensor_keys, set(self.non_tensor_batch), "non_tensor_batch"),
            (meta_keys, set(self.meta_info), "meta_info"),
        ):
            missing = sorted(set(wanted or []) - have)
            if missing:
                raise KeyError(f"{op}: {kind} has no key(s) {missing}; present: {sorted(have)}")

    # ------------------------------------------------------------------ splitting and joining
    def is_padding_enabled(self) -> bool:
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False))

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` parts. Exact split required unless auto-padding is enabled, in which
        case the first ``len % chunks`` parts get one extra row. Each part owns its meta_info copy."""
        n = len(self)
        if chunks < 1:
            raise DataProtoError(f"chunk: chunks must be >= 1, got {chunks}")
        if n % chunks and not self.is_padding_enabled():
            raise DataProtoError(
                f"chunk: a batch of {n} does not split into {chunks} equal parts; "
                "enable auto-padding (DataProto.from_dict(..., auto_padding=True)) or fix the batch size"
            )
        base, extra = divmod(n, chunks)
        sizes = [base + (1 if i < extra else 0) for i in range(chunks)]
        return self.split(sizes)

    def split(self, split_size: int | Sequence[int]) -> list[DataProto]:
        """Parts of ``split_size`` rows (the last may be shorter), or of the listed sizes."""
        n = len(self)
        if isinstance(split_size, int):
            sizes = [min(split_size, n - start) for start in range(0, n, split_size)] or [0]
        else:
            sizes = list(split_size)
        if sum(sizes) != n:
            raise DataProtoError(f"split: sizes {sizes} do not add up to the batch size {n}")
        bounds = np.cumsum([0, *sizes])
        return [self.slice(int(bounds[i]), int(bounds[i + 1])) for i in range(len(sizes))]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Join along the batch dim. ``meta_info["metrics"]`` from every part is collected into a dict of
        lists; other meta keys must agree across parts."""
        if not data:
            raise DataProtoError("concat: nothing to concatenate")
        batches = [d.batch for d in data]
        if any(b is None for b in batches) and not all(b is None for b in batches):
            raise DataProtoError("concat: some parts have tensors and others do not")
        batch = torch.cat(batches, dim=0) if batches[0] is not None else None
        keys = set(data[0].non_tensor_batch)
        for d in data[1:]:
            if set(d.non_tensor_batch) != keys:
                raise DataProtoError(
                    f"concat: non_tensor_batch keys differ: {sorted(keys)} vs {sorted(d.non_tensor_batch)}"
                )
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in keys}
        meta: dict = {}
        metrics: list[dict] = []
        for d in data:
            for key, value in d.meta_info.items():
                if key == "metrics":
                    metrics.extend(value if isinstance(value, list) else [value])
                elif key in meta and not _values_equal(meta[key], value):
                    raise DataProtoError(
                        f"concat: Conflicting values for meta_info key {key!r} ({meta[key]!r} vs {value!r})"
                    )
                else:
                    meta[key] = copy.deepcopy(value)
        if metrics:
            meta["metrics"] = _list_of_dict_to_dict_of_list([m for m in metrics if m])
        return type(data[0])(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def reorder(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Permute the rows in place: row ``i`` becomes the old row ``indices[i]``."""
        index = torch.as_tensor(np.asarray(indices)).long()
        if index.shape != (len(self),):
            raise DataProtoError(f"reorder: expected {len(self)} indices, got {tuple(index.shape)}")
        if self.batch is not None:
            self.batch = self.batch[index]
        np_index = index.numpy()
        self.non_tensor_batch = {k: v[np_index] for k, v in self.non_tensor_batch.items()}

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``[a,a,b,b]`` when interleaved, ``[a,b,a,b]`` otherwise."""
        n = len(self)
        if interleave:
            index = np.repeat(np.arange(n), repeat_times)
        else:
            index = np.tile(np.arange(n), repeat_times)
        return self.select_idxs(index)

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times, rows kept in order (verl's semantics).

        ``repeat_times`` is a 1-D list/tuple/array/tensor of ``len(self)`` non-negative counts; e.g.
        rows ``[a, b, c]`` with ``[2, 0, 1]`` give ``[a, a, c]``. The result owns a copy of meta_info."""
        counts = np.asarray(repeat_times.tolist() if isinstance(repeat_times, torch.Tensor) else repeat_times)
        if counts.ndim != 1 or len(counts) != len(self):
            raise DataProtoError(
                f"sample_level_repeat: need one count per row ({len(self)}), got shape {counts.shape}"
            )
        if counts.size and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
            raise DataProtoError(f"sample_level_repeat: counts must be non-negative integers, got {counts}")
        return self.select_idxs(np.repeat(np.arange(len(self)), counts.astype(np.int64)))

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Each row becomes ``n_split`` rows; see :func:`hybridflow.protocol_ops.unfold_column_chunks`."""
        return unfold_column_chunks(self, n_split, split_keys)

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first (default) or last (``"last"``) row, in place."""
        if padding_size <= 0:
            return
        source = self.slice(-1, None) if padding_candidate == "last" else self.slice(0, 1)
        filler = source.select(meta_info_keys=[]).repeat(padding_size)
        padded = DataProto.concat([self.select(meta_info_keys=[]), filler])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    # ------------------------------------------------------------------ iteration, devices, disk
    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        shuffle: bool = False,
        dataloader_kwargs: dict | None = None,
    ) -> Iterator[DataProto]:
        """Yield mini-batches of ``mini_batch_size`` rows for ``epochs`` passes (PPO's inner loop).

        With ``shuffle`` (or ``dataloader_kwargs={"shuffle": True}`` as in verl) each epoch uses a fresh
        permutation drawn from a generator seeded with ``seed``, so the order is reproducible."""
        n = len(self)
        if mini_batch_size <= 0 or n % mini_batch_size:
            raise DataProtoError(
                f"make_iterator: batch of {n} is not divisible by mini_batch_size={mini_batch_size}"
            )
        shuffle = shuffle or bool((dataloader_kwargs or {}).get("shuffle", False))
        generator = torch.Generator()
        generator.manual_seed(0 if seed is None else seed)
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
            for start in range(0, n, mini_batch_size):
                yield self.select_idxs(order[start : start + mini_batch_size])

    def to(self, device: str | torch.device) -> DataProto:
        """Move tensors to ``device`` in place; returns ``self``."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Write atomically (temp file + rename): an interrupted save never leaves a torn file."""
        tmp = f"{filepath}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(self, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, filepath)

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike) -> DataProto:
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"{filepath} holds a {type(data).__name__}, not a DataProto")
        return data

    # ------------------------------------------------------------------ TensorDict interchange
    def to_tensordict(self) -> TensorDict:
        """One TensorDict holding everything, as verl's ``to_tensordict``: tensors as they are,
        each non-tensor column as a ``NonTensorStack`` of its ``B`` values and each meta_info entry as
        ``NonTensorData``. Keys must be unique across the three. Values are not copied."""
        tensors = dict(self.batch.items()) if self.batch is not None else {}
        columns = {k: v.tolist() for k, v in self.non_tensor_batch.items()}
        return tensordict_from_parts(tensors, columns, self.meta_info, batch_size=len(self))

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1
    ) -> DataProto:
        """Inverse of :meth:`to_tensordict`: tensors → ``batch``, ``NonTensorStack`` → object arrays in
        ``non_tensor_batch``, ``NonTensorData`` → ``meta_info`` (merged over a copy of ``meta_info``).

        The batch size is the first tensor's leading ``num_batch_dims`` dims (verl's rule); with
        non-tensor columns only ``num_batch_dims=1`` is possible, and a DataProto holds one batch dim,
        so larger values are refused by :meth:`check_consistency`."""
        if num_batch_dims < 1:
            raise DataProtoError(f"from_tensordict: num_batch_dims must be >= 1, got {num_batch_dims}")
        tensors, columns, meta = tensordict_to_parts(tensor_dict)
        if (columns or meta) and num_batch_dims != 1:
            raise DataProtoError("from_tensordict: a TensorDict with non-tensor data needs num_batch_dims=1")
        merged = copy.deepcopy(meta_info or {})
        merged.update(meta)
        batch = None
        if tensors:
            batch_size = list(next(iter(tensors.values())).shape[:num_batch_dims])
            batch = TensorDict(tensors, batch_size=batch_size)
        non_tensor = {k: _to_object_array(v) for k, v in columns.items()}
        return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=merged)

    # ------------------------------------------------------------------ pickling (Ray transport)
    def __getstate__(self) -> dict:
        return {
            "batch": tensordict_to_state(self.batch),
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict) -> None:
        self.batch = tensordict_from_state(state["batch"])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def __repr__(self) -> str:
        keys = list(self.batch.keys()) if self.batch is not None else []
        return (
            f"DataProto(len={len(self)}, batch_keys={keys}, "
            f"non_tensor_keys={list(self.non_tensor_batch)}, meta_keys={list(self.meta_info)})"
        )


class DataProtoFuture:
    """A DataProto that is not on the driver yet: Ray object refs plus how to assemble them.

    The controller passes one worker group's output (``refs``, one per collected rank) straight to
    another group without fetching it: ``chunk`` makes one future per receiving rank, and the worker
    materialises its part with :meth:`get` (the ``@register`` wrapper does it automatically).

    - ``collect_fn(list_of_results) -> DataProto`` joins the fetched parts (default: concat);
    - ``dispatch_fn(DataProto) -> DataProto`` selects this future's share of the joined result.
    """

    def __init__(self, futures: list, collect_fn=None, dispatch_fn=None) -> None:
        self.futures = list(futures)
        self.collect_fn = collect_fn or DataProto.concat
        self.dispatch_fn = dispatch_fn

    @classmethod
    def concat(cls, data: list) -> DataProtoFuture:
        """A future for the concatenation of the DataProtos behind the object refs ``data``."""
        return cls(futures=data, collect_fn=DataProto.concat)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures; future ``i`` resolves to ``self.get().chunk(chunks)[i]``."""
        return [
            DataProtoFuture(self.futures, self.collect_fn, _ChunkSelector(i, chunks, self.dispatch_fn))
            for i in range(chunks)
        ]

    def get(self) -> DataProto:
        import ray

        output = self.collect_fn(ray.get(self.futures))
        return self.dispatch_fn(output) if self.dispatch_fn is not None else output


@dataclass
class _ChunkSelector:
    """Picklable ``DataProto -> DataProto``: part ``index`` of ``chunks`` (after an optional inner fn)."""

    index: int
    chunks: int
    inner: Any = None

    def __call__(self, data: DataProto) -> DataProto:
        if self.inner is not None:
            data = self.inner(data)
        return data.chunk(self.chunks)[self.index]
