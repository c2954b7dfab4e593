"""The rollouter (:mod:`hybridflow.trainer.fully_async.rollouter`) on a fake agent-loop manager, in this
process (no Ray, no model): the staleness budget across a validation between two syncs, and a serve-loop
watcher that fails."""

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.fully_async.message_queue import GroupQueue, RolloutStopped
from hybridflow.trainer.fully_async.rollouter import Rollouter
from hybridflow.trainer.fully_async.trainer import FullyAsyncTrainer


def _prompts():
    """One-prompt batches in data order (index 0, 1, ...), forever."""
    index = 0
    while True:
        ids = torch.tensor([[1, 2, 3]])
        prompt = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(3)[None]},
            non_tensors={"index": np.array([index], dtype=object)},
        )
        yield prompt, 0
        index += 1


class FakeManager:
    """The calls the rollouter makes of an AgentLoopManager. Every sample finishes at once with one
    token of the current weights, unless ``hold`` is set: then samples wait until the servers fail.
    ``watch_error``: the serve-loop watcher raises it after ``watch_after_s``."""

    server_names = ["replica 0 (rank 0)"]

    def __init__(self, hold: bool = False, watch_error: BaseException | None = None) -> None:
        self.hold, self.watch_error, self.watch_after_s = hold, watch_error, 0.3
        self.version = 0
        self.failed: str | None = None
        self.starts = 0

    def start_serving(self, rows=None):
        self.starts += 1
        return [], ["serve-loop"]

    def watch_serving(self, serve_refs, stop) -> None:
        start = time.monotonic()
        while not stop():
            if self.watch_error is not None and time.monotonic() - start > self.watch_after_s:
                raise self.watch_error
            time.sleep(0.01)

    def stop_serving(self, serve_refs):
        return []

    def abort_all(self) -> int:
        return 0

    def fail_servers(self, reason: str) -> None:
        self.failed = reason

    async def generate_async(self, prompts: DataProto, worker: int = 0) -> DataProto:
        while self.hold:
            if self.failed is not None:
                raise RuntimeError(self.failed)
            await asyncio.sleep(0.01)
        rows = len(prompts)
        output = DataProto.from_dict({"responses": torch.ones(rows, 1, dtype=torch.long)})
        versions = np.empty(rows, dtype=object)
        versions[:] = [[[self.version, 1]] for _ in range(rows)]
        output.non_tensor_batch["weight_versions"] = versions
        return output


def _rollouter(manager: FakeManager, max_groups: int) -> Rollouter:
    queue = GroupQueue(capacity=max_groups * 4)
    return Rollouter(manager, _prompts(), queue, n=1, max_groups=max_groups, partial_rollout=False)


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "condition not reached"
        time.sleep(0.01)


def _validating_trainer(rollouter: Rollouter, version: int) -> FullyAsyncTrainer:
    """A FullyAsyncTrainer with only what ``validate`` reads (validation itself is stubbed out)."""
    trainer = object.__new__(FullyAsyncTrainer)
    trainer.rollouter, trainer.rollouter_started, trainer.param_version = rollouter, True, version
    return trainer


def test_validation_between_two_syncs_keeps_the_staleness_budget(monkeypatch):
    """A validation pauses and resumes the rollouter without moving weights: the groups admitted since
    the last sync still count, so no more than ``max_groups`` groups are ever generated with one
    parameter version (before, the resume handed the budget of the groups already trained back)."""
    import hybridflow.trainer.ppo.validation as validation

    monkeypatch.setattr(validation, "run_validation", lambda trainer: {"val/score": 1.0})
    manager = FakeManager()
    rollouter = _rollouter(manager, max_groups=2)
    rollouter.start(0)
    try:
        _wait_until(lambda: rollouter.queue.size() == 2 and not rollouter.in_flight)
        groups, _ = rollouter.queue.take(2)  # the trainer's step
        assert _validating_trainer(rollouter, 0).validate() == {"val/score": 1.0}
        time.sleep(0.5)  # room for the rollouter to (wrongly) admit more
        assert rollouter.admitted == 2, "a validation handed back staleness budget"
        assert rollouter.metrics()["fully_async/count/staleness_samples"] == 2
        # a real sync (version 1) starts a new budget: two more groups, with the new weights
        rollouter.pause()
        manager.version = 1
        rollouter.resume(1)
        _wait_until(lambda: rollouter.queue.size() == 2 and not rollouter.in_flight)
        time.sleep(0.3)
        assert rollouter.admitted == 4
        groups += rollouter.queue.take(2)[0]
        assert [g.admitted_version for g in groups] == [0, 0, 1, 1]
    finally:
        rollouter.queue.fail(RuntimeError("test over"))
        rollouter.stop()


def test_a_failed_serve_loop_watcher_ends_the_run_within_seconds_naming_the_replica():
    """The watcher that turns a dead replica into an error raised: nothing would notice the replica
    dying from then on, so the trainer's next take raises within seconds, naming the replica, and the
    samples waiting on the servers return (before, the error vanished and the take waited on)."""
    manager = FakeManager(hold=True, watch_error=ConnectionError("the GCS is unreachable"))
    rollouter = _rollouter(manager, max_groups=2)
    rollouter.start(0)
    start = time.monotonic()
    try:
        with pytest.raises(RolloutStopped) as stopped:
            rollouter.queue.take(1, timeout_s=20)
        assert time.monotonic() - start < 5
        message = str(stopped.value)
        assert "replica 0 (rank 0)" in message and "watcher" in message and "GCS" in message, message
        _wait_until(lambda: manager.failed is not None)  # the waiting samples were released
        rollouter._thread.join(timeout=10)
        assert not rollouter._thread.is_alive(), "the rollouter did not stop"
    finally:
        rollouter.stop()


def test_a_pause_after_the_rollouter_failed_raises_its_failure_not_a_closed_loop():
    """The trainer pauses the rollouter for a sync after the rollouter's thread ended on a replica's
    failure (its event loop closed): the pause raises that failure, naming the replica (before:
    ``RuntimeError('Event loop is closed')``, which hid it), and a stop afterwards is quiet."""
    manager = FakeManager(hold=True, watch_error=ConnectionError("replica 0 (rank 0) died"))
    rollouter = _rollouter(manager, max_groups=2)
    rollouter.start(0)
    try:
        rollouter._thread.join(timeout=20)
        assert not rollouter._thread.is_alive() and rollouter._loop.is_closed()
        for call in (rollouter.pause, lambda: rollouter.resume(1)):
            with pytest.raises(RolloutStopped, match=r"replica 0 \(rank 0\) died"):
                call()
    finally:
        rollouter.stop()


def test_the_watcher_names_the_replica_it_was_failing(ray_session):
    """The manager's watcher names the replica whose server it could not fail."""
    from hybridflow.workers.rollout.agent_loop.manager import AgentLoopManager

    manager = object.__new__(AgentLoopManager)
    manager.server_names = ["replica 0 (rank 0)", "replica 1 (rank 1)"]

    def fail_server(ref, replica):
        raise ConnectionError("server actor gone")

    manager._fail_server = fail_server
    import ray

    ended = ray.put(None)
    stop = threading.Event()
    with pytest.raises(RuntimeError, match=r"replica 0 \(rank 0\).*ConnectionError"):
        manager.watch_serving([ended], stop.is_set)
