"""The driver's side of a checkpoint engine, and the worker methods it calls.

:class:`CheckpointEngineWorker` is mixed into the workers that hold an engine (the actor's
``ActorRolloutRefWorker``, the standalone rollout replica): ``init_checkpoint_engine`` builds the
rank's engine once, ``execute_checkpoint_engine`` runs one of its methods with per-rank arguments
(verl's names). :class:`CheckpointEngineManager` runs a sync over the two worker groups: prepare, build
the topology, join the group, then the trainer's ranks send while the rollout's receive, then finalize.
"""

from __future__ import annotations

import time

import torch

from hybridflow.single_controller import Dispatch, register
from hybridflow.workers.checkpoint_engine.base import MIB, CheckpointEngine, CheckpointEngineRegistry


def new_checkpoint_engine(
    backend: str, role: str, bucket_megabytes: int, rollout_dtype: str, engine_kwargs: dict | None = None
) -> CheckpointEngine:
    """One rank's engine: ``backend`` (a registered name), ``role`` trainer | rollout, buckets of
    ``bucket_megabytes`` MiB, tensors sent as ``rollout_dtype`` (a torch dtype name)."""
    dtype = getattr(torch, str(rollout_dtype).removeprefix("torch."))
    size = int(float(bucket_megabytes) * MIB)
    return CheckpointEngineRegistry.new(backend, size, dtype, role=role, **dict(engine_kwargs or {}))


class CheckpointEngineWorker:
    """Worker methods for a checkpoint engine (mixed into a :class:`~hybridflow.single_controller.Worker`)."""

    checkpoint_engine: CheckpointEngine | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_checkpoint_engine(
        self, backend: str, role: str, bucket_megabytes: int, rollout_dtype: str, engine_kwargs=None
    ) -> None:
        self.checkpoint_engine = new_checkpoint_engine(
            backend, role, bucket_megabytes, rollout_dtype, engine_kwargs
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def execute_checkpoint_engine(self, method: str, **kwargs):
        """``method`` of this rank's engine with its own ``kwargs`` (verl's name)."""
        return getattr(self.checkpoint_engine, method)(**kwargs)


def _rss_mib(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process from ``/proc/self/status``, MiB (0 where unknown)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def measured_sync(run) -> tuple:
    """``(run(), stats)`` with ``stats``: ``seconds``, ``rss_before_mb`` (resident set before) and
    ``peak_rss_mb`` (the peak during ``run``: :func:`~hybridflow.utils.device.phase_peak_rss`), so
    ``peak - before`` is the sync's extra host memory on this rank."""
    from hybridflow.utils.device import phase_peak_rss

    before, start = _rss_mib("VmRSS"), time.perf_counter()
    with phase_peak_rss() as peak:
        result = run()
    seconds = time.perf_counter() - start
    return result, {"seconds": seconds, "rss_before_mb": before, "peak_rss_mb": peak.get("gb", 0.0) * 1024}


class CheckpointEngineManager:
    """Moves the actor's weights (``trainer``: its worker group) to every rollout rank (``rollout``) with
    the checkpoint engine ``backend`` (verl's class name). The workers' engines are built here, once.

    ``trainer`` must offer ``send_weights_by_checkpoint_engine`` and ``rollout``
    ``receive_weights_by_checkpoint_engine(version, sent)`` besides :class:`CheckpointEngineWorker`'s."""

    def __init__(
        self,
        backend: str,
        trainer,
        rollout,
        bucket_megabytes: int,
        rollout_dtype: str,
        engine_kwargs: dict | None = None,
    ) -> None:
        self.backend, self.backend_cls = backend, CheckpointEngineRegistry.get(backend)
        if self.backend_cls.colocated:
            raise ValueError(f"checkpoint engine {backend}: trainer and rollout share a process, no manager")
        self.trainer, self.rollout = trainer, rollout
        # trainer rank 0's send_weights result (object_store: a reference to the whole model), dropped
        # after each sync unless keep_last_sent (it would hold the model in the object store)
        self.last_sent, self.keep_last_sent = None, False
        self.last_stats: dict[str, list] = {}
        self._peers: tuple | None = None  # the rollout workers of the last sync (a kept group's members)
        args = (backend, bucket_megabytes, rollout_dtype, engine_kwargs or {})
        self._engine_args = args
        self._wait(
            trainer.init_checkpoint_engine_async(args[0], "trainer", *args[1:]),
            rollout.init_checkpoint_engine_async(args[0], "rollout", *args[1:]),
        )

    @staticmethod
    def _wait(*futures):
        from hybridflow.single_controller.ray.base import wait_futures

        return wait_futures(list(futures))

    def init_rollout_workers(self, rollout):
        """Build the engine on new rollout workers (``rollout``: a group of them, e.g. a restarted
        replica's); returns the call's future (it runs after what the workers were already given)."""
        args = self._engine_args
        return rollout.init_checkpoint_engine_async(args[0], "rollout", *args[1:])

    def _on_all(
        self,
        method: str,
        trainer_kwargs: dict | None = None,
        rollout_kwargs: dict | None = None,
        rollout=None,
    ):
        """``method`` on every rank of both groups at once (a rendezvous needs both sides)."""
        calls = []
        rollout = rollout or self.rollout
        for group, kwargs in ((self.trainer, trainer_kwargs or {}), (rollout, rollout_kwargs or {})):
            calls.append(group.execute_checkpoint_engine_async([method] * group.world_size, **kwargs))
        return self._wait(*calls)

    def update_weights(self, version: int, rollout=None) -> dict[str, float]:
        """One sync: the replicas now hold the trainer's weights as parameter ``version``. Returns
        ``timing_s/param_sync`` and ``fully_async/param_sync/*`` (the parts, bytes, peak RSS per side).
        ``rollout``: only these rollout workers (a view of the group: a restarted replica's load)."""
        start = time.perf_counter()
        rollout = rollout or self.rollout
        peers = tuple(worker._actor_id.hex() for worker in rollout.workers)
        if self._peers is not None and peers != self._peers:  # other processes than the kept group's
            self._on_all("reset", rollout=rollout)
        self._peers = peers
        trainer_meta, rollout_meta = self._on_all("prepare", rollout=rollout)
        trainer_kwargs, rollout_kwargs = self.backend_cls.build_topology(
            self.trainer.world_size, rollout.world_size, list(trainer_meta) + list(rollout_meta)
        )
        self._on_all("init_process_group", trainer_kwargs, rollout_kwargs, rollout=rollout)
        setup = time.perf_counter() - start
        sent = self.trainer.send_weights_by_checkpoint_engine_async()
        if getattr(self.backend_cls, "receives_payload", False):  # the receivers read rank 0's result
            (sent_stats,) = self._wait(sent)
            self.last_sent = sent_stats[0][0]
            received = rollout.receive_weights_by_checkpoint_engine_async(version, self.last_sent)
            (loaded,) = self._wait(received)
        else:  # a collective: both sides at once
            received = rollout.receive_weights_by_checkpoint_engine_async(version, None)
            sent_stats, loaded = self._wait(sent, received)
        self._on_all("finalize", rollout=rollout)
        if not self.keep_last_sent:
            self.last_sent = None
        stats = [s[1] for s in sent_stats]
        self.last_stats = {"trainer": stats, "rollout": loaded}  # per rank (the benchmark's figures)
        return {
            "timing_s/param_sync": time.perf_counter() - start,
            "fully_async/param_sync/setup_s": setup,
            "fully_async/param_sync/export_s": max(s["seconds"] for s in stats),
            "fully_async/param_sync/load_s": max(r["load_s"] for r in loaded),
            "fully_async/param_sync/engine_sync_s": max(r["engine_sync_s"] for r in loaded),
            "fully_async/param_sync/sent_mb": sum(s.get("sent_bytes", 0.0) for s in stats) / MIB,
            "fully_async/param_sync/trainer_extra_rss_mb": max(_extra(s) for s in stats),
            "fully_async/param_sync/rollout_extra_rss_mb": max(_extra(r) for r in loaded),
        }


def _extra(stats: dict) -> float:
    return max(stats["peak_rss_mb"] - stats["rss_before_mb"], 0.0)
