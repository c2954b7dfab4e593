"""Backend-neutral pieces of the single controller: resource pools and worker groups.

A ``WorkerGroup`` turns every ``@register``-ed method of its worker class into a method of the
group. Calling ``wg.compute_x(data)`` on the controller then

1. dispatches: the method's dispatch mode turns ``(data,)`` into per-rank arguments;
2. executes: each rank (or rank 0 only) runs the method, concurrently;
3. collects: outputs of the collected ranks are joined, and auto-padding rows are stripped.

``wg.compute_x_async(data)`` does 1-2 and returns a future (a ``DataProtoFuture`` when the method
returns DataProtos, so its output can feed another group without visiting the controller).
The backend (Ray) supplies only ``_submit`` (start one rank's call) and ``_gather`` (wait for calls).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.protocol import AUTO_PADDING_KEY, DataProto, DataProtoFuture, unpad_dataproto
from hybridflow.single_controller.decorator import (
    DispatchMode,
    Execute,
    RegisterSpec,
    registered_methods,
)


@dataclass
class ClassWithInitArgs:
    """A worker class plus the arguments to construct it with, inside each worker process."""

    cls: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __init__(self, cls: type, *args, **kwargs) -> None:
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def __call__(self):
        return self.cls(*self.args, **self.kwargs)


class ResourcePool:
    """``process_on_nodes[i]`` worker processes on node ``i``; up to ``max_colocate_count`` worker
    groups may share each process slot (colocated roles)."""

    def __init__(self, process_on_nodes: list[int], max_colocate_count: int = 1) -> None:
        if not process_on_nodes or any(n <= 0 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes must be positive counts, got {process_on_nodes}")
        self.process_on_nodes = list(process_on_nodes)
        self.max_colocate_count = int(max_colocate_count)

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def local_world_size_list(self) -> list[int]:
        return [n for n in self.process_on_nodes for _ in range(n)]

    def local_rank_list(self) -> list[int]:
        return [i for n in self.process_on_nodes for i in range(n)]


@dataclass(frozen=True)
class _ConcatUnpad:
    """Picklable collect function for DataProto futures: concat, then drop auto-padding rows.

    ``auto_padding`` carries the caller's choice forward: when the input allowed padding, the future's
    result may be chunked unevenly by the next group it feeds (its length is unknown to the driver)."""

    pad_size: int = 0
    auto_padding: bool = False

    def __call__(self, outputs: list) -> DataProto:
        data = unpad_dataproto(DataProto.concat(outputs), self.pad_size)
        if self.auto_padding:
            data.meta_info[AUTO_PADDING_KEY] = True
        return data


class GroupFuture:
    """The pending result of a non-blocking group call that does not return DataProtos.

    ``group``, ``method`` and ``rank_refs`` (``{rank: backend future}`` of the collected ranks) let a
    caller wait on several calls at once (``hybridflow.single_controller.ray.wait_futures``)."""

    def __init__(self, group: WorkerGroup, method: str, futures: dict[int, Any], finish: Callable) -> None:
        self.group, self.method, self.rank_refs, self._finish = group, method, futures, finish

    def finish(self, outputs: dict[int, Any]):
        """The call's result from ``{rank: output}`` of the collected ranks."""
        return self._finish([outputs[rank] for rank in self.rank_refs])

    def get(self):
        return self.finish(self.group._gather(self.rank_refs, self.method))


class GroupDataProtoFuture(DataProtoFuture):
    """A :class:`DataProtoFuture` that remembers the group call it came from, so waiting on it reports
    a failed or dead rank as the group does (group, rank, pid, method). Pickled (passed to another
    group whole) it travels as a plain ``DataProtoFuture``."""

    def __init__(self, group: WorkerGroup, method: str, rank_refs: dict[int, Any], collect_fn) -> None:
        super().__init__(list(rank_refs.values()), collect_fn=collect_fn)
        self.group, self.method, self.rank_refs = group, method, dict(rank_refs)

    def finish(self, outputs: dict[int, Any]) -> DataProto:
        return self.collect_fn([outputs[rank] for rank in self.rank_refs])

    def get(self) -> DataProto:
        return self.finish(self.group._gather(self.rank_refs, self.method))

    def __reduce__(self):
        return DataProtoFuture, (self.futures, self.collect_fn, self.dispatch_fn)


class WorkerGroup:
    """A set of ``world_size`` workers driven as one; see the module docstring."""

    def __init__(self, name: str, role: str | None = None) -> None:
        self.name = name
        self.role = role  # set for a colocated role's view of a shared worker process
        self._dispatch_info_cache: dict[str, tuple[list[int], list[bool]]] = {}

    # -- provided by the backend -----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        """Start ``method(*args, **kwargs)`` on ``rank``; return a backend future."""
        raise NotImplementedError

    def _gather(self, futures: dict[int, Any], method: str) -> dict[int, Any]:
        """Wait for ``{rank: future}``; return ``{rank: output}``; raise naming group, rank, method."""
        raise NotImplementedError

    # -- binding ---------------------------------------------------------------------------------
    def _bind_worker_methods(self, worker_cls: type, role: str | None = None) -> list[str]:
        """Expose each registered method of ``worker_cls`` as ``self.<name>`` and ``self.<name>_async``.

        For a colocated worker class, ``role`` selects that role's methods (their remote names carry
        the role prefix, see ``create_colocated_worker_cls``) and binds them under their own names."""
        specs = registered_methods(worker_cls)
        if role is None:
            names = {name: name for name in specs}
        else:
            names = dict(worker_cls.role_methods[role])
        for public, remote_name in names.items():
            if hasattr(type(self), public):
                raise ValueError(f"worker method {public!r} would shadow WorkerGroup.{public}")
            spec = specs[remote_name]
            setattr(self, public, self._make_group_method(remote_name, spec, spec.blocking))
            setattr(self, f"{public}_async", self._make_group_method(remote_name, spec, False))
        return sorted(names)

    def _make_group_method(self, remote_name: str, spec: RegisterSpec, blocking: bool):
        def group_method(*args, **kwargs):
            return self._call(remote_name, spec, args, kwargs, blocking)

        group_method.__name__ = remote_name
        return group_method

    # -- one call: dispatch, execute, collect ----------------------------------------------------
    def _call(self, method: str, spec: RegisterSpec, args: tuple, kwargs: dict, blocking: bool):
        mode: DispatchMode = spec.dispatch_mode
        try:
            per_rank_args, per_rank_kwargs, pad_size = _normalise_dispatch(
                mode.dispatch_fn(self, *args, **kwargs)
            )
        except (ValueError, TypeError, KeyError) as err:
            raise type(err)(f"worker group {self.name!r}, method {method!r}: {err}") from err
        ranks = [0] if spec.execute_mode is Execute.RANK_ZERO else list(range(self.world_size))
        futures = {
            rank: self._submit(
                rank,
                method,
                tuple(a[rank] for a in per_rank_args),
                {k: v[rank] for k, v in per_rank_kwargs.items()},
            )
            for rank in ranks
        }
        collect_ranks = mode.collect_ranks_fn(self) if mode.collect_ranks_fn else ranks
        collected = {rank: futures[rank] for rank in collect_ranks}
        if blocking:
            outputs = self._gather(futures, method)
            result = mode.collect_fn(self, [outputs[rank] for rank in collect_ranks])
            return unpad_dataproto(result, pad_size) if isinstance(result, DataProto) else result
        if mode.returns_dataproto:
            padding = any(
                isinstance(a, DataProto) and a.is_padding_enabled() for a in (*args, *kwargs.values())
            )
            return GroupDataProtoFuture(self, method, collected, _ConcatUnpad(pad_size, padding))
        return GroupFuture(self, method, collected, lambda outs: mode.collect_fn(self, outs))

    def query_dispatch_info(self, mesh_name: str) -> tuple[list[int], list[bool]]:
        """``(dp_rank per worker, is_collect per worker)`` for ``mesh_name``, asked once and cached."""
        if mesh_name not in self._dispatch_info_cache:
            role_kwargs = {"role": self.role} if self.role else {}
            futures = {
                r: self._submit(r, "query_dispatch_info", (mesh_name,), role_kwargs)
                for r in range(self.world_size)
            }
            infos = self._gather(futures, "query_dispatch_info")
            self._dispatch_info_cache[mesh_name] = (
                [infos[r][0] for r in range(self.world_size)],
                [infos[r][1] for r in range(self.world_size)],
            )
        return self._dispatch_info_cache[mesh_name]

    def execute_all(self, method: str, *args, **kwargs) -> list:
        """Call ``method`` (registered or not) with the same arguments on every rank; outputs by rank."""
        futures = {r: self._submit(r, method, args, kwargs) for r in range(self.world_size)}
        outputs = self._gather(futures, method)
        return [outputs[r] for r in range(self.world_size)]

    def execute_rank_zero(self, method: str, *args, **kwargs):
        return self._gather({0: self._submit(0, method, args, kwargs)}, method)[0]


def _normalise_dispatch(result: tuple) -> tuple[list, dict, int]:
    """Dispatch functions return ``(args, kwargs)`` or ``(args, kwargs, pad_size)``."""
    if len(result) == 2:
        return list(result[0]), dict(result[1]), 0
    args, kwargs, pad_size = result
    return list(args), dict(kwargs), int(pad_size)
