"""On-policy distillation: the PPO step with a served teacher's top-k in every batch, and its schedulers.

The step is :class:`~hybridflow.trainer.ppo.ray_trainer.RayPPOTrainer`'s; only where a batch comes from
changes (:meth:`OnPolicyDistillTrainer.collect_rollouts`): the student generates, the teacher
(:mod:`.teacher`) scores every response position, and the batch carries ``teacher_topk_logps`` /
``teacher_topk_indices`` (B, T_r, k) into the actor's update (:mod:`hybridflow.workers.actor.distill`).
Rewards and advantages are still computed (the accuracy is reported, and
``distill_loss.use_policy_loss=true`` mixes in the policy loss).

``trainer.scheduler`` (verl's names, plus ``sequential``) sets how far generation runs ahead of the
update, d batches:

- ``sequential`` (d = 0; verl's plain on-policy loop): generate batch k, score it, update on it. The same
  phases in the same order as a run without a scheduler; every batch comes from the current weights.
- ``one_step_off`` (d = 1): batch k + 1 is generated before the update on batch k, so it comes from the
  weights one update old; its scoring runs on the teacher while the driver waits for the update on k.
- ``two_step_off`` (d = 2): two batches ahead; two updates old; scoring has two steps to finish.

Warm-up: the first step generates d + 1 batches. Each batch is sampled with the streams of the step that
trains it, so the modes differ only in the weights that generate. ``distill/staleness`` reports, per
step, how many updates the trained batch's weights are behind (0, 1, 2).

What overlaps here: the actor and the rollout share processes (the hybrid engine), so generation and the
update alternate on them; the teacher is its own server, so its scoring overlaps both. The timing keys
are verl's: ``timing_s/wait_prev_gen`` (generating this step's new batch), ``timing_s/wait_prev_teacher``
(one_step_off) or ``timing_s/wait_prev_prev_teacher`` (two_step_off) or ``timing_s/get_teacher_knowledge``
(sequential): the wait for the trained batch's scores; ``timing_s/sync_rollout_weights``: the engine's
weight load before generating.
"""

from __future__ import annotations

from collections import deque

from hybridflow import keys
from hybridflow.trainer.ppo.ray_trainer import RayPPOTrainer
from hybridflow.utils.timer import marked_timer

SCHEDULERS = {"sequential": 0, "one_step_off": 1, "two_step_off": 2}
TEACHER_WAIT = {0: "get_teacher_knowledge", 1: "wait_prev_teacher", 2: "wait_prev_prev_teacher"}


class OnPolicyDistillTrainer(RayPPOTrainer):
    """``teacher``: a :class:`~.teacher.TeacherClient`; the rest is :class:`RayPPOTrainer`'s."""

    def __init__(self, *args, teacher, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher
        self.depth = SCHEDULERS[str(self.config.trainer.scheduler)]
        self._ahead: deque = deque()  # (batch, teacher future, the update count of its weights)
        self._generated = None  # batches generated so far (set at the first step: resumed runs)
        if self.depth:  # a batch from older weights differs from the actor's recompute by design
            self.log_prob_gap_limit = None

    def fit(self) -> dict[str, float]:
        try:
            return super().fit()
        finally:
            self.teacher.close()  # its event-loop thread and connections

    def collect_rollouts(self, data_iter, metrics: dict, timing: dict):
        """The batch to train at this step (module docstring), generated up to d steps ago."""
        if self._generated is None:
            self._generated = self.global_steps - 1
        synced = 0.0  # the engine's weight loads (0 when it held the weights already): verl's name below
        while len(self._ahead) <= self.depth and self._generated < self.total_training_steps:
            timing.pop("update_weights", None)
            with marked_timer("wait_prev_gen", timing):
                batch = self._generate_for(self._generated + 1, next(data_iter), metrics, timing)
            synced += timing.get("update_weights", 0.0)
            self._generated += 1
            self._ahead.append((batch, self.teacher.submit(batch), self.global_steps - 1))
        timing["update_weights"] = timing["sync_rollout_weights"] = synced
        batch, scoring, weights_version = self._ahead.popleft()
        with marked_timer(TEACHER_WAIT[self.depth], timing):
            top_log_probs, top_ids, teacher_metrics = scoring.result()
        batch.batch[keys.TEACHER_TOPK_LOG_PROBS] = top_log_probs
        batch.batch[keys.TEACHER_TOPK_IDS] = top_ids
        metrics.update(teacher_metrics)
        metrics["distill/staleness"] = float(self.global_steps - 1 - weights_version)
        return batch

    def _generate_for(self, step: int, prompts, metrics: dict, timing: dict):
        """Generate the batch that step ``step`` trains, with that step's sampling streams (the rollout
        seeds its samples by ``global_steps``): the schedulers differ only in the weights that generate."""
        current, self.global_steps = self.global_steps, step
        try:
            return self.generate_with_baselines(prompts, metrics, timing)
        finally:
            self.global_steps = current
