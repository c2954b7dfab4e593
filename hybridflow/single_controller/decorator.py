"""``@register``: a worker method declares, where it is defined, how the controller distributes it.

A *dispatch mode* is a pair of functions run on the controller:

- ``dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)`` turns the caller's arguments into
  per-rank arguments: every positional arg becomes a list of ``world_size`` values, every kwarg too.
  It may return a third element, the number of padding rows it added (stripped after collection);
- ``collect_fn(worker_group, outputs) -> result`` joins the outputs of the collected ranks.

Built-in modes live in :class:`Dispatch`; users add their own with :func:`register_dispatch_mode`, or
pass ``{"dispatch_fn": ..., "collect_fn": ...}`` directly to ``@register``.
:func:`make_nd_compute_dataproto_dispatch_fn` builds the mesh-aware mode of the HybridFlow paper's
3D transfer protocol: ranks that share a data-parallel rank (e.g. one tensor-parallel group) get the
same shard, and only the ranks marked as collectors return their output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hybridflow.protocol import DataProto, DataProtoFuture, pad_dataproto_to_divisor

MAGIC_ATTR = "__hybridflow_register__"


@dataclass(frozen=True)
class DispatchMode:
    """How a method's arguments go out to the ranks and how their outputs come back."""

    name: str
    dispatch_fn: Callable[..., tuple]
    collect_fn: Callable[[Any, list], Any]
    # Ranks whose outputs are collected, in collection order (None: all ranks in rank order).
    collect_ranks_fn: Callable[[Any], list[int]] | None = None
    # True when collect_fn concatenates DataProtos: non-blocking calls then return a DataProtoFuture.
    returns_dataproto: bool = False


class Execute(Enum):
    """Which ranks run the method: all of them, or rank 0 only."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


# ----------------------------------------------------------------------------- dispatch functions
def _replicate(worker_group, *args, **kwargs):
    n = worker_group.world_size
    return [[a] * n for a in args], {k: [v] * n for k, v in kwargs.items()}


def _check_per_rank(worker_group, *args, **kwargs):
    n = worker_group.world_size
    for value in (*args, *kwargs.values()):
        if not isinstance(value, (list, tuple)) or len(value) != n:
            raise ValueError(f"this dispatch mode needs every argument as a list of {n} per-rank values")
    return [list(a) for a in args], {k: list(v) for k, v in kwargs.items()}


def _split_dataprotos(args: tuple, kwargs: dict, parts: int) -> tuple[list, dict, int]:
    """Chunk every DataProto/DataProtoFuture argument into ``parts`` shards; replicate the rest.

    When a DataProto has auto-padding enabled and its length does not divide ``parts``, it is padded
    by cycling its own rows; the padding size is returned so the collected output can be trimmed."""
    pad_size = 0

    def split(value):
        nonlocal pad_size
        if isinstance(value, DataProtoFuture):
            return value.chunk(parts)
        if isinstance(value, DataProto):
            if value.is_padding_enabled() and len(value) % parts:
                value, pad_size = pad_dataproto_to_divisor(value, parts)
            return value.chunk(parts)
        return [value] * parts

    split_args = [split(a) for a in args]
    split_kwargs = {k: split(v) for k, v in kwargs.items()}
    return split_args, split_kwargs, pad_size


def _dispatch_dp_proto(worker_group, *args, **kwargs):
    return _split_dataprotos(args, kwargs, worker_group.world_size)


def _dispatch_dp_proto_with_func(worker_group, fn, *args, **kwargs):
    if not callable(fn):
        raise TypeError("DP_COMPUTE_PROTO_WITH_FUNC needs a function as its first argument")
    split_args, split_kwargs, pad_size = _split_dataprotos(args, kwargs, worker_group.world_size)
    return [[fn] * worker_group.world_size, *split_args], split_kwargs, pad_size


def _collect_all(worker_group, outputs):
    return list(outputs)


def _collect_first(worker_group, outputs):
    return outputs[0]


def _collect_dataproto(worker_group, outputs):
    for rank, out in enumerate(outputs):
        if not isinstance(out, DataProto):
            raise TypeError(f"a DataProto-collecting method returned {type(out).__name__} (output {rank})")
    return DataProto.concat(outputs)


# ----------------------------------------------------------------------------- mesh-aware dispatch
def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> DispatchMode:
    """Dispatch by the data-parallel rank each worker declared for ``mesh_name``.

    Workers call ``self.register_dispatch_collect_info(mesh_name, dp_rank, is_collect)`` in
    ``__init__`` or ``init_model``. The data is chunked into ``dp_size`` shards; worker ``r`` gets shard
    ``dp_rank[r]``; only workers with ``is_collect`` return output, concatenated in dp-rank order."""

    def dispatch_fn(worker_group, *args, **kwargs):
        dp_ranks, _ = worker_group.query_dispatch_info(mesh_name)
        dp_size = max(dp_ranks) + 1
        split_args, split_kwargs, pad_size = _split_dataprotos(args, kwargs, dp_size)
        per_rank_args = [[shards[dp] for dp in dp_ranks] for shards in split_args]
        per_rank_kwargs = {k: [shards[dp] for dp in dp_ranks] for k, shards in split_kwargs.items()}
        return per_rank_args, per_rank_kwargs, pad_size

    def collect_ranks_fn(worker_group):
        dp_ranks, collect_mask = worker_group.query_dispatch_info(mesh_name)
        collected = [r for r in range(len(dp_ranks)) if collect_mask[r]]
        if sorted(dp_ranks[r] for r in collected) != list(range(max(dp_ranks) + 1)):
            raise ValueError(f"mesh {mesh_name!r}: collectors must cover each dp rank exactly once")
        return sorted(collected, key=lambda r: dp_ranks[r])

    return DispatchMode(
        name=f"nd_compute_dataproto[{mesh_name}]",
        dispatch_fn=dispatch_fn,
        collect_fn=_collect_dataproto,
        collect_ranks_fn=collect_ranks_fn,
        returns_dataproto=True,
    )


# ----------------------------------------------------------------------------- the mode registry
class Dispatch:
    """Built-in dispatch modes (verl's names)."""

    RANK_ZERO = DispatchMode("RANK_ZERO", _replicate, _collect_first)
    ONE_TO_ALL = DispatchMode("ONE_TO_ALL", _replicate, _collect_all)
    ALL_TO_ALL = DispatchMode("ALL_TO_ALL", _check_per_rank, _collect_all)
    DP_COMPUTE = DispatchMode("DP_COMPUTE", _check_per_rank, _collect_all)
    DP_COMPUTE_PROTO = DispatchMode(
        "DP_COMPUTE_PROTO", _dispatch_dp_proto, _collect_dataproto, returns_dataproto=True
    )
    DP_COMPUTE_PROTO_WITH_FUNC = DispatchMode(
        "DP_COMPUTE_PROTO_WITH_FUNC", _dispatch_dp_proto_with_func, _collect_dataproto, returns_dataproto=True
    )
    DP_COMPUTE_METRIC = DispatchMode("DP_COMPUTE_METRIC", _dispatch_dp_proto, _collect_all)


_MODES: dict[str, DispatchMode] = {
    name: value for name, value in vars(Dispatch).items() if isinstance(value, DispatchMode)
}


def register_dispatch_mode(name: str, dispatch_fn: Callable, collect_fn: Callable, **options) -> DispatchMode:
    """Add a user-defined mode, usable as ``@register(dispatch_mode="NAME")`` or ``Dispatch.NAME``."""
    if name in _MODES:
        raise ValueError(f"dispatch mode {name!r} is already registered")
    mode = DispatchMode(name, dispatch_fn, collect_fn, **options)
    _MODES[name] = mode
    setattr(Dispatch, name, mode)
    return mode


def get_dispatch_mode(mode: DispatchMode | str | dict) -> DispatchMode:
    """Resolve a mode given as a DispatchMode, a registered name, or ``{"dispatch_fn", "collect_fn"}``."""
    if isinstance(mode, DispatchMode):
        return mode
    if isinstance(mode, dict):
        return DispatchMode("custom", mode["dispatch_fn"], mode["collect_fn"])
    if mode not in _MODES:
        raise KeyError(f"unknown dispatch mode {mode!r}; registered: {sorted(_MODES)}")
    return _MODES[mode]


# ----------------------------------------------------------------------------- @register
@dataclass(frozen=True)
class RegisterSpec:
    dispatch_mode: DispatchMode
    execute_mode: Execute
    blocking: bool


def _materialize(value):
    return value.get() if isinstance(value, DataProtoFuture) else value


def _accelerator_of(worker):
    """The worker's compute device when it is an accelerator (GPU), else None (nothing to move)."""
    device = getattr(worker, "compute_device", None)
    return device if device is not None and device.type != "cpu" else None


def _to_device(value, device):
    """A DataProto moved to ``device``; other values as they are."""
    return value.to(device) if isinstance(value, DataProto) else value


def register(
    dispatch_mode: DispatchMode | str | dict = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
):
    """Mark a worker method as callable from the controller through a worker group.

    ``blocking=False`` makes ``wg.method(...)`` return a future (``DataProtoFuture`` for
    DataProto-collecting modes); ``wg.method_async(...)`` is always non-blocking."""
    spec = RegisterSpec(get_dispatch_mode(dispatch_mode), Execute(execute_mode), blocking)

    def decorator(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if materialize_futures:
                args = tuple(_materialize(a) for a in args)
                kwargs = {k: _materialize(v) for k, v in kwargs.items()}
            device = _accelerator_of(args[0]) if args else None
            if device is None:
                return fn(*args, **kwargs)
            # Once on entry: the worker's tensors all live on its device; the controller gets CPU data.
            args = tuple(_to_device(a, device) for a in args)
            kwargs = {k: _to_device(v, device) for k, v in kwargs.items()}
            return _to_device(fn(*args, **kwargs), "cpu")

        setattr(inner, MAGIC_ATTR, spec)
        return inner

    return decorator


def registered_methods(cls: type) -> dict[str, RegisterSpec]:
    """``{method name: RegisterSpec}`` for every ``@register``-ed method of ``cls`` (inherited too)."""
    found = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), MAGIC_ATTR, None)
        if isinstance(spec, RegisterSpec):
            found[name] = spec
    return found
