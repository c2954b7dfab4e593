"""Ray backend of the single controller: placement groups, one Ray actor per worker, fault reporting.

Layout: a :class:`RayResourcePool` reserves one placement group per node with one bundle per worker
process (``{"CPU": cpus_per_process}`` plus ``{"GPU": 1}`` when ``use_gpu``). A
:class:`RayWorkerGroup` starts one Ray actor per bundle, taking ``1 / max_colocate_count`` of it so
that several groups (roles) can share the same devices, and gives each actor the torch.distributed
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and a fixed
thread budget. The same code runs with ``use_gpu=False`` on a laptop and with GPUs on a cluster.
"""

from __future__ import annotations

import copy
import os
import uuid

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from hybridflow.single_controller.base import ClassWithInitArgs, ResourcePool, WorkerGroup
from hybridflow.single_controller.ray.nodes import (
    NodeInfo,
    find_dead_worker,
    looks_like_lost_peer,
    node_info,
    pin_to_node,
    schedulable_nodes,
)
from hybridflow.utils.device import worker_env
from hybridflow.utils.ports import find_free_port


class WorkerDiedError(RuntimeError):
    """A worker process of a group died (killed, crashed, out of memory) during a call. ``node`` is
    the node it ran on (a :class:`~.nodes.NodeInfo`, ``alive=False`` when the whole node left the
    cluster), or None when unknown."""

    def __init__(self, message: str, node: NodeInfo | None = None) -> None:
        super().__init__(message)
        self.node = node

    @property
    def node_lost(self) -> bool:
        return self.node is not None and not self.node.alive


class RayResourcePool(ResourcePool):
    """Ray placement groups for ``process_on_nodes`` worker processes (one group per node)."""

    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        cpus_per_process: float = 1.0,
        name_prefix: str = "",
        ready_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(process_on_nodes, max_colocate_count)
        self.use_gpu = use_gpu
        self.cpus_per_process = cpus_per_process
        # Placement-group names are cluster-wide: a random suffix keeps two pools of one name apart.
        self.name_prefix = f"{name_prefix or 'pool'}_{uuid.uuid4().hex[:6]}"
        self.ready_timeout_s = ready_timeout_s
        self._placement_groups: list[PlacementGroup] | None = None
        self._bundle_nodes: list[str] | None = None

    def bundle(self) -> dict[str, float]:
        resources = {"CPU": self.cpus_per_process}
        if self.use_gpu:
            resources["GPU"] = 1
        return resources

    def get_placement_groups(self, strategy: str = "STRICT_PACK") -> list[PlacementGroup]:
        """Create (once) and wait for the placement groups; a clear error if they cannot be placed.

        On a multi-node cluster, entry ``i`` of ``process_on_nodes`` is pinned to node ``i`` of
        :func:`~.nodes.schedulable_nodes` (the same order for every pool)."""
        if self._placement_groups is None:
            nodes = schedulable_nodes(self.bundle())
            if len(self.process_on_nodes) > max(len(nodes), 1):
                raise RuntimeError(
                    f"resource pool {self.name_prefix!r} asks for {len(self.process_on_nodes)} nodes "
                    f"({self.process_on_nodes} workers) but the Ray cluster has {len(nodes)} alive node(s) "
                    f"with {self.bundle()} to spare per worker: start more nodes (ray start) or lower "
                    "trainer.nnodes"
                )
            groups = [
                placement_group(
                    [self.bundle()] * n,
                    strategy=strategy,
                    name=f"{self.name_prefix}_node{i}",
                    **(pin_to_node(nodes[i].node_id, n) if len(nodes) > 1 else {}),
                )
                for i, n in enumerate(self.process_on_nodes)
            ]
            for i, pg in enumerate(groups):
                if not pg.wait(timeout_seconds=self.ready_timeout_s):
                    where = f" on {nodes[i].describe()}" if len(nodes) > 1 else ""
                    raise RuntimeError(
                        f"resource pool {self.name_prefix!r}: placement group for node {i}{where} "
                        f"({self.process_on_nodes[i]} x {self.bundle()}) not ready after "
                        f"{self.ready_timeout_s}s; cluster resources: {ray.available_resources()}"
                    )
            self._placement_groups = groups
            # Recorded now: after a node failure Ray reschedules the bundles and the table changes.
            self._bundle_nodes = [
                ray.util.placement_group_table(pg)["bundles_to_node_id"][b]
                for pg, n in zip(groups, self.process_on_nodes, strict=True)
                for b in range(n)
            ]
        return self._placement_groups

    @property
    def rank_node_ids(self) -> list[str]:
        """The node id of each worker rank's bundle (after :meth:`get_placement_groups`)."""
        if self._bundle_nodes is None:
            self.get_placement_groups()
        return list(self._bundle_nodes)

    def release(self) -> None:
        """Return the reserved resources to the cluster (after the pool's worker groups are shut down)."""
        for pg in self._placement_groups or []:
            ray.util.remove_placement_group(pg)
        self._placement_groups = None

    def actor_resources(self) -> dict[str, float]:
        """What one worker actor takes from its bundle: a ``1/max_colocate_count`` share."""
        share = 1.0 / self.max_colocate_count
        return {"num_cpus": self.cpus_per_process * share, "num_gpus": share if self.use_gpu else 0}


class RayClassWithInitArgs(ClassWithInitArgs):
    """A worker class, its constructor arguments, and extra Ray actor options."""

    def __init__(self, cls: type, *args, **kwargs) -> None:
        super().__init__(cls, *args, **kwargs)
        self.ray_options: dict = {}

    def update_options(self, options: dict) -> RayClassWithInitArgs:
        self.ray_options.update(options)
        return self


def worker_runtime_env(env_vars: dict[str, str], extra: dict | None = None) -> dict:
    """A worker's Ray ``runtime_env``: its environment variables and the ``extra`` entries (a copy)."""
    extra = copy.deepcopy(extra or {})
    if "env_vars" in extra:
        raise ValueError("runtime_env: pass the workers' environment variables as env, not env_vars")
    return {"env_vars": env_vars, **extra}


def _node_ip_of_bundle(pg: PlacementGroup, bundle_index: int) -> tuple[str, str]:
    """``(node_id, node_ip)`` hosting a placement group's bundle."""
    node_id = ray.util.placement_group_table(pg)["bundles_to_node_id"][bundle_index]
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node_id, node["NodeManagerAddress"]
    raise RuntimeError(f"node {node_id} of placement group {pg.id} not found")


@ray.remote(num_cpus=0)
def _free_port_on_node(host: str) -> int:
    return find_free_port(host)


def _master_addr_port(pg: PlacementGroup) -> tuple[str, int]:
    """Rendezvous address for rank 0: loopback on a one-node cluster (the driver's own node),
    otherwise the IP of rank 0's node with a port found free on that node."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) == 1:
        return "127.0.0.1", find_free_port("127.0.0.1")
    node_id, node_ip = _node_ip_of_bundle(pg, 0)
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return node_ip, ray.get(_free_port_on_node.options(scheduling_strategy=strategy).remote(node_ip))


class RayWorkerGroup(WorkerGroup):
    """``world_size`` Ray actors running ``ray_cls_with_init``; registered methods become group methods.

    Args:
        resource_pool: where the workers go (one worker per bundle).
        ray_cls_with_init: the worker class and its constructor arguments.
        name_prefix: names the group in actor names and error messages.
        num_threads: torch/OpenMP threads per worker process (keep workers x threads <= cores).
        env: extra environment variables for every worker.
        runtime_env: extra entries of every worker's Ray ``runtime_env``, next to its ``env_vars``
            (e.g. ``{"nsight": {...}}``: the worker process runs under ``nsys profile``).
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        name_prefix: str | None = None,
        num_threads: int = 1,
        env: dict[str, str] | None = None,
        runtime_env: dict | None = None,
        _workers: list | None = None,
        _role: str | None = None,
        _process_info_refs: dict | None = None,
    ) -> None:
        super().__init__(name_prefix or f"wg_{uuid.uuid4().hex[:6]}", role=_role)
        self.ray_cls_with_init = ray_cls_with_init
        self.resource_pool = resource_pool
        self._spawn_options: list[dict] = []  # each rank's actor options (replace_worker starts it again)
        if _workers is None:
            _workers = self._spawn(resource_pool, ray_cls_with_init, num_threads, env or {}, runtime_env)
        self._workers = _workers
        # Asked now, read on first use: creating the group does not wait for the processes to start
        # (the driver's own set-up overlaps their imports), and the answer is queued ahead of any
        # later call, so reading it never waits behind a long-running method.
        self._process_info: list[dict] | None = None
        self._process_info_refs = _process_info_refs or {
            rank: self._submit(rank, "process_info", (), {}) for rank in range(len(_workers))
        }
        self._bind_worker_methods(ray_cls_with_init.cls, role=_role)

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list:
        return list(self._workers)

    @property
    def process_info(self) -> list[dict]:
        """Each rank's ``Worker.process_info()`` (waits for the workers to be up, once)."""
        if self._process_info is None:
            outputs = self._gather(self._process_info_refs, "process_info")
            self._process_info = [outputs[rank] for rank in range(self.world_size)]
        return self._process_info

    @property
    def worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.process_info]

    @property
    def device_names(self) -> list[str]:
        """Each rank's device as it reports it (``cpu``, or the GPU's name)."""
        return [info.get("device_name", "cpu") for info in self.process_info]

    # ------------------------------------------------------------------ spawning
    def _spawn(
        self,
        pool: RayResourcePool,
        cls_with_init: RayClassWithInitArgs,
        num_threads: int,
        extra_env: dict,
        runtime_env: dict | None = None,
    ) -> list:
        pgs = pool.get_placement_groups()
        master_addr, master_port = _master_addr_port(pgs[0])
        remote_cls = ray.remote(cls_with_init.cls)
        workers, rank = [], 0
        for pg, local_world_size in zip(pgs, pool.process_on_nodes, strict=True):
            for local_rank in range(local_world_size):
                env = {
                    "WORLD_SIZE": str(pool.world_size),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(local_world_size),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "HYBRIDFLOW_WORKER_GROUP": self.name,
                    "HYBRIDFLOW_NUM_THREADS": str(num_threads),
                    "OMP_NUM_THREADS": str(num_threads),
                    "MKL_NUM_THREADS": str(num_threads),
                    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                    "TOKENIZERS_PARALLELISM": "false",
                    **worker_env("cuda" if pool.use_gpu else "cpu"),  # a CPU worker sees no GPU
                    # the verl alias (hybridflow.verl_compat) follows the driver, on a cluster it joined too
                    **{k: os.environ[k] for k in ("HYBRIDFLOW_VERL_ALIAS",) if k in os.environ},
                    **extra_env,
                }
                options = {
                    **pool.actor_resources(),
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=local_rank
                    ),
                    "runtime_env": worker_runtime_env(env, runtime_env),
                    "name": f"{self.name}_rank{rank}_{uuid.uuid4().hex[:4]}",
                    **cls_with_init.ray_options,
                }
                self._spawn_options.append(options)
                workers.append(
                    remote_cls.options(**options).remote(*cls_with_init.args, **cls_with_init.kwargs)
                )
                rank += 1
        return workers

    def replace_worker(self, rank: int):
        """Start a new process for ``rank`` (one whose process died) in the same bundle with the same
        environment, and make it the group's rank ``rank``; returns its actor handle. Only for a group
        this one spawned (its views share the list of workers, so they see the new one too)."""
        if rank >= len(self._spawn_options):
            raise RuntimeError(f"worker group {self.name!r} did not spawn rank {rank}: it cannot replace it")
        try:
            ray.kill(self._workers[rank], no_restart=True)
        except Exception:  # noqa: S110  (already gone: the usual case)
            pass
        options = {**self._spawn_options[rank], "name": f"{self.name}_rank{rank}_{uuid.uuid4().hex[:4]}"}
        cls_with_init = self.ray_cls_with_init
        worker = (
            ray.remote(cls_with_init.cls)
            .options(**options)
            .remote(*cls_with_init.args, **cls_with_init.kwargs)
        )
        self._workers[rank] = worker
        self._process_info_refs[rank] = self._submit(rank, "process_info", (), {})
        self._process_info = None  # read again (the new pid)
        return worker

    def view(self, ranks: list[int]) -> RayWorkerGroup:
        """A group of some of this group's workers (their ranks stay theirs; calls dispatch over the
        view's positions): a call on a few replicas, e.g. the weight load of a restarted one."""
        return RayWorkerGroup(
            resource_pool=None,
            ray_cls_with_init=self.ray_cls_with_init,
            name_prefix=f"{self.name}/ranks{'-'.join(map(str, ranks))}",
            _workers=[self._workers[r] for r in ranks],
            _role=self.role,
        )

    def spawn(self, prefix_set) -> dict[str, RayWorkerGroup]:
        """For a colocated worker class: one group view per role, sharing these worker processes."""
        return {
            role: RayWorkerGroup(
                resource_pool=self.resource_pool,
                ray_cls_with_init=self.ray_cls_with_init,
                name_prefix=f"{self.name}/{role}",
                _workers=self._workers,
                _role=role,
                _process_info_refs=self._process_info_refs,
            )
            for role in prefix_set
        }

    # ------------------------------------------------------------------ execution
    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict):
        return getattr(self._workers[rank], method).remote(*args, **kwargs)

    def _gather(self, futures: dict[int, ray.ObjectRef], method: str) -> dict[int, object]:
        """Wait for every rank, surfacing the first failure at once (a dead rank must not leave the
        controller waiting on peers blocked in a collective with it)."""
        pending = {ref: rank for rank, ref in futures.items()}
        outputs = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                rank = pending.pop(ref)
                outputs[rank] = self._get_one(ref, rank, method)
        return outputs

    def _get_one(self, ref: ray.ObjectRef, rank: int, method: str):
        where = f"worker group {self.name!r} rank {rank}"
        if getattr(self, "_process_info", None):
            where += f" (pid {self._process_info[rank]['pid']})"
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            cause = err.as_instanceof_cause()
            # a collective that lost its peer: report the peer that died (and its node), not the symptom
            dead = (
                find_dead_worker(self._workers, self._rank_node_ids())
                if looks_like_lost_peer(cause)
                else None
            )
            if dead is not None:
                symptom = next(line for line in str(cause).splitlines() if looks_like_lost_peer(line))
                seen = f"rank {rank} saw {type(cause).__name__}: {symptom.strip()[:300]}"
                raise self._died(dead[0], method, seen, dead[1]) from cause
            cause.add_note(f"raised in {where}, method {method!r}")
            raise cause from None
        except ray.exceptions.RayActorError as err:
            # which worker is gone, and whether its node went with it (an unreachable worker is
            # "unavailable" until Ray's health checks declare its node dead)
            dead = find_dead_worker(self._workers, self._rank_node_ids()) or (rank, self.rank_node(rank))
            raise self._died(dead[0], method, f"{err.__class__.__name__}: {err}", dead[1]) from err

    def _died(self, rank: int, method: str, detail: str, node: NodeInfo | None) -> WorkerDiedError:
        where = f"worker group {self.name!r} rank {rank}"
        if getattr(self, "_process_info", None):
            where += f" (pid {self._process_info[rank]['pid']})"
        if node is not None and not node.alive:
            where += f" on node {node.describe()}, which left the Ray cluster,"
        return WorkerDiedError(f"{where} died during {method!r}: {detail}", node=node)

    def _rank_node_ids(self) -> list[str] | None:
        pool = self.resource_pool
        return pool.rank_node_ids if pool is not None and pool._bundle_nodes is not None else None

    def rank_node(self, rank: int) -> NodeInfo | None:
        """The node ``rank`` was placed on, as the cluster sees it now (None if unknown)."""
        node_ids = self._rank_node_ids()
        return node_info(node_ids[rank]) if node_ids else None

    def shutdown(self, release_resources: bool = True) -> None:
        """Kill the group's worker processes (also for role views: they share the processes) and, by
        default, release the resource pool it was spawned on."""
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
        if release_resources and self.resource_pool is not None:
            self.resource_pool.release()


def wait_futures(futures: list, on_ready=None) -> list:
    """Results of several non-blocking group calls (``GroupFuture`` / ``GroupDataProtoFuture``, e.g.
    from different worker groups), waited on together. ``on_ready(i)`` is called the moment call
    ``i`` has every rank's output. The first failure of any rank is raised at once, reported as its
    group reports it (a dead rank must not leave the driver waiting on the others)."""
    pending = {ref: (i, rank) for i, f in enumerate(futures) for rank, ref in f.rank_refs.items()}
    outputs: list[dict] = [{} for _ in futures]
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            i, rank = pending.pop(ref)
            outputs[i][rank] = futures[i].group._get_one(ref, rank, futures[i].method)
            if len(outputs[i]) == len(futures[i].rank_refs) and on_ready is not None:
                on_ready(i)
    return [f.finish(out) for f, out in zip(futures, outputs, strict=True)]
