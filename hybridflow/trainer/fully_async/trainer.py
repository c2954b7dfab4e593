"""The fully-asynchronous trainer: the PPO step of :class:`~hybridflow.trainer.ppo.ray_trainer.RayPPOTrainer`
on groups streamed by the :class:`~.rollouter.Rollouter` from a pool of its own.

Each step takes ``require_batches x ppo_mini_batch_size`` groups from the queue (oldest first) instead of
generating, then runs the same phases (rewards arrive computed in the agent loops; old / reference
log-probs, advantages, updates). After every ``trigger_parameter_sync_step`` steps the rollouter pauses
(aborting in-flight requests with ``partial_rollout``, else draining them), the actor's weights move to
the rollout replicas as the next parameter version, and the rollouter resumes. After every sync a probe
checks that each replica now samples with the trainer's weights (:mod:`.sync_probe`): a broken sync stops
the run naming the replica, whatever the staleness or the source of the old log-probs.

Checkpoints hold, besides the models and the optimizer, how many groups were trained and the parameter
version: a resumed run's rollouter starts at the first prompt not yet trained (groups in flight or
queued at the save are generated again, with the restored weights), so no prompt is trained twice or
skipped.
"""

from __future__ import annotations

import time

import numpy as np

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.trainer.fully_async.message_queue import GroupQueue, RolloutGroup
from hybridflow.trainer.fully_async.param_sync import build_weight_sync, sync_parameters
from hybridflow.trainer.ppo.ray_trainer import RayPPOTrainer
from hybridflow.workers.rollout.agent_loop.manager import concat_rows


class TrainedPosition:
    """What the checkpoint keeps of the data stream (in place of a dataloader's state): groups trained
    and the parameter version. ``len`` is the steps per epoch (for the run's length)."""

    def __init__(self, trainer: FullyAsyncTrainer, steps_per_epoch: int) -> None:
        self.trainer, self.steps_per_epoch = trainer, int(steps_per_epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def state_dict(self) -> dict[str, int]:
        return {"groups_trained": self.trainer.queue.taken, "param_version": self.trainer.param_version}

    def load_state_dict(self, state: dict) -> None:
        self.trainer.queue.reset_position(int(state["groups_trained"]))
        self.trainer.param_version = int(state["param_version"])


class FullyAsyncTrainer(RayPPOTrainer):
    """``rollouter`` streams groups into ``queue``; ``rollout_group`` is the rollout pool's worker group
    (for the parameter sync); ``manager`` serves validation on it."""

    def __init__(
        self,
        config,
        tokenizer,
        val_dataloader,
        reward_fn,
        val_reward_fn,
        *,
        queue: GroupQueue,
        rollouter,
        rollout_group,
        manager,
        steps_per_epoch: int,
        tracker=None,
        worker_groups=None,
    ) -> None:
        self.queue = queue
        self.param_version = 0
        super().__init__(
            config,
            tokenizer,
            TrainedPosition(self, steps_per_epoch),
            val_dataloader,
            reward_fn,
            val_reward_fn,
            tracker=tracker,
            worker_groups=worker_groups,
        )
        self.rollouter, self.rollout_group, self.rollout_manager = rollouter, rollout_group, manager
        asynchronous = config.async_training
        self.required_groups = int(asynchronous.require_batches) * int(
            config.actor_rollout_ref.actor.ppo_mini_batch_size
        )
        self.sync_every = int(asynchronous.trigger_parameter_sync_step)
        self.rollouter_started = False
        self.actor_at_synced_version = False  # the actor's weights are the replicas' (param_version)
        self.weight_sync = None  # the checkpoint engine's manager, built with the first sync
        self.wait_s = 0.0
        self.sync_probe_limit = self.log_prob_gap_limit  # the probe after each sync (None: off)
        self._sync_probe = None
        if float(asynchronous.staleness_threshold) > 0 or self.sync_every > 1:
            # samples from older weights differ from the recompute by design: the step's gap limit holds
            # only when every sample comes from the weights being trained (the probe checks every sync)
            self.log_prob_gap_limit = None

    def init_workers(self) -> None:
        """The trainer pool's models (no rollout engine: the rollouter's pool generates)."""
        self.wg.init_models(total_training_steps=self.total_training_steps)
        for line in self.wg.describe():
            print(f"hybridflow: trainer {line}", flush=True)

    # ------------------------------------------------------------------ the step's rollouts
    def collect_rollouts(self, data_iter, metrics: dict, timing: dict) -> DataProto:
        """The next groups, oldest first (see :mod:`.message_queue`), as one batch (each group's prompts
        are padded to its own longest: they are left-padded to the widest group's first)."""
        self._start_rollouter()
        groups, waited = self._take_groups()
        timing["wait_for_samples"] = waited
        self.wait_s += waited
        metrics.update(self._group_metrics(groups))
        return concat_rows([group.batch for group in groups])

    def _take_groups(self) -> tuple[list[RolloutGroup], float]:
        """The step's groups and the seconds waited for them. While waiting, a restarted replica gets
        the current weights (:meth:`_load_restarted_replicas`): the actor is idle then."""
        waited = 0.0
        while True:
            self._load_restarted_replicas()
            try:
                groups, more = self.queue.take(self.required_groups, timeout_s=1.0)
                return groups, waited + more
            except TimeoutError:
                waited += 1.0

    def _load_restarted_replicas(self) -> None:
        """Replicas restarted after their process died (:mod:`hybridflow.workers.rollout.agent_loop.
        elastic`) get the actor's weights through the checkpoint engine and serve again, when those
        weights are the replicas' version (no update since the last sync); else the next sync gives
        them the weights, as to every replica."""
        elastic = getattr(self.rollout_manager, "elastic", None)
        if elastic is not None and elastic.pending and self.actor_at_synced_version:
            elastic.load_pending(self.param_version)

    def _group_metrics(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """Staleness of the trained samples (the version of the weights being trained minus the oldest
        version of their tokens) and how many were aborted and resumed (tokens of several versions)."""
        gaps, spans, partial = [], [], 0
        for group in groups:
            for row in group.versions or [[] for _ in range(len(group.batch))]:
                versions = [span[0] for span in row] or [group.admitted_version]
                gaps.append(self.param_version - min(versions))
                spans.append(max(versions) - min(versions))
                partial += int(len(row) > 1)
        gaps_array = np.asarray(gaps)
        found = {
            "fully_async/staleness/mean": float(gaps_array.mean()),
            "fully_async/staleness/max": float(gaps_array.max()),
            "fully_async/partial/partial_ratio": partial / max(len(gaps), 1),
            "fully_async/partial/max_partial_span": float(max(spans, default=0)),
            "fully_async/count/groups_trained": float(self.queue.taken),
        }
        for gap in range(int(gaps_array.max()) + 1):
            found[f"fully_async/staleness/gap_{gap}"] = float((gaps_array == gap).mean())
        return found

    def _start_rollouter(self) -> None:
        """Once, before the first step's groups: the replicas get the trainer's weights (a resumed run's
        too) and the rollouter starts at the first group not yet trained."""
        if self.rollouter_started:
            return
        self.weight_sync = build_weight_sync(self.config, self.wg.actor_rollout, self.rollout_group)
        elastic = getattr(self.rollout_manager, "elastic", None)
        if elastic is not None:  # a restarted replica's weights come through it
            elastic.weight_sync = self.weight_sync
        sync_parameters(self.weight_sync, self.param_version)
        self.actor_at_synced_version = True
        self.rollouter.start(self.param_version, start_seq=self.queue.taken)
        self.rollouter_started = True
        self.probe_sync()
        self._last_step_end = time.monotonic()

    def probe_sync(self) -> dict[str, float]:
        """After a sync, with the replicas serving: every replica must sample with the weights just sent
        (:class:`~.sync_probe.SyncProbe`; raises naming the replica). Off when the gap limit is off."""
        if self.sync_probe_limit is None:
            return {}
        if self._sync_probe is None:
            from hybridflow.trainer.fully_async.sync_probe import SyncProbe

            manager = self.rollout_manager
            self._sync_probe = SyncProbe(
                self.tokenizer,
                self.config.actor_rollout_ref.rollout,
                self.sync_probe_limit,
                manager.servers,
                manager.server_names,
                self.wg.actor_rollout,
            )
        return self._sync_probe.check(self.param_version)

    def old_log_prob_phase(self, batch: DataProto, metrics: dict):
        """``async_training.use_rollout_log_probs`` (without ``compute_prox_log_prob``): the rollout's
        log-probs are π_old, no forward; else the recompute with the trainer's current weights (the
        proximal policy of decoupled PPO)."""
        asynchronous = self.config.async_training
        rollout_log_probs = batch.batch.get(keys.ROLLOUT_LOG_PROBS, None)
        if asynchronous.use_rollout_log_probs and not asynchronous.compute_prox_log_prob:
            if rollout_log_probs is None:
                raise ValueError(
                    "async_training.use_rollout_log_probs needs rollout.calculate_log_probs=true"
                )
            batch.batch[keys.OLD_LOG_PROBS] = rollout_log_probs.clone()
            return None
        return super().old_log_prob_phase(batch, metrics)

    # ------------------------------------------------------------------ the parameter sync
    def after_update(self) -> dict[str, float]:
        """Every ``trigger_parameter_sync_step`` steps: pause the rollouter, move the weights, resume.
        Also the trainer's idle ratio: the share of the time since the last step it waited for groups."""
        now = time.monotonic()
        elapsed = now - getattr(self, "_last_step_end", now - 1e-9)
        step_metrics = {"fully_async/trainer/idle_ratio": min(self.wait_s / max(elapsed, 1e-9), 1.0)}
        self._last_step_end, self.wait_s = now, 0.0
        if self.global_steps % self.sync_every != 0:
            self.actor_at_synced_version = False  # the replicas hold older weights than the actor now
            return {**step_metrics, **self.rollouter.metrics()}
        start = time.perf_counter()
        rollouter_metrics = self.rollouter.metrics()
        self.rollouter.pause()
        self.param_version += 1
        sync = sync_parameters(self.weight_sync, self.param_version)
        self.actor_at_synced_version = True
        elastic = getattr(self.rollout_manager, "elastic", None)
        if elastic is not None:  # the sync loaded restarted replicas too: they serve from the resume
            elastic.weights_loaded()
        self.rollouter.resume(self.param_version)
        window = time.perf_counter() - start
        probe = self.probe_sync()
        return {
            **step_metrics,
            **rollouter_metrics,
            **sync,
            **probe,
            "fully_async/param_sync/pause_resume_s": window,
        }

    def validate(self) -> dict[str, float]:
        """Validation on the rollout pool, between two streaming phases (the rollouter pauses)."""
        if not self.rollouter_started:
            return super().validate()
        self.rollouter.pause()
        try:
            return super().validate()
        finally:
            self.rollouter.resume(self.param_version, synced=False)  # no weights moved: same budget

    def fit(self) -> dict[str, float]:
        try:
            return super().fit()
        finally:
            if self.rollouter_started:
                self.rollouter.stop()
