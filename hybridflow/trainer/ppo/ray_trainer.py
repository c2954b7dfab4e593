"""The PPO/GRPO single controller: the whole RL step, read top to bottom in ``fit_step``.

The driver holds no model. It moves ``DataProto`` batches between worker groups — the hybrid
actor/rollout/reference group, the critic, the optional reward model — and runs the cheap maths
(rewards from rule functions, advantages, KL control) itself::

    prompts ─ generate ─┬ reward ──────┬ advantage ─┬ update_critic
                        ├ old_log_prob ┤            └ update_actor
                        ├ ref_log_prob ┤
                        └ values ──────┘

Each phase is a method taking and returning a DataProto, timed as ``timing_s/<phase>``. Phases in one
column read nothing of each other and are issued together (:mod:`.concurrent_phases`): they overlap
when their roles are on different resource pools (``trainer.placement``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from omegaconf import DictConfig

from hybridflow import keys
from hybridflow.algorithms import (
    AdvantageInputs,
    apply_kl_penalty_to_rewards,
    compute_advantage,
    get_kl_controller,
)
from hybridflow.algorithms.rollout_correction import RolloutCorrection
from hybridflow.protocol import AUTO_PADDING_KEY, DataProto
from hybridflow.trainer.ppo import metric_utils
from hybridflow.trainer.ppo.checkpointing import TrainerCheckpointer
from hybridflow.trainer.ppo.concurrent_phases import Phase, run_phases
from hybridflow.trainer.ppo.dynamic_sampling import GroupFilter
from hybridflow.trainer.ppo.preemption import StopRequest, TrainingPreempted
from hybridflow.trainer.ppo.rollouts import chat_template_meta, rollout_with_uids
from hybridflow.trainer.ppo.step_profiler import StepProfiler
from hybridflow.trainer.ppo.workers_setup import WorkerGroups, build_worker_groups
from hybridflow.utils.roles import (
    ESTIMATORS_NEEDING_GREEDY_BASELINE,
    need_critic,
    need_reference,
    reward_model_worker,
    update_computes_old_log_probs,
)
from hybridflow.utils.rollout_parity import check_log_prob_gap, gap_limit, parity_tolerance
from hybridflow.utils.seqlen_balancing import get_seqlen_balanced_partitions, log_seqlen_unbalance
from hybridflow.utils.timer import marked_timer
from hybridflow.utils.torch_functional import masked_mean


class RayPPOTrainer:
    """Drives PPO-family training over Ray worker groups. ``config`` is the resolved full tree."""

    def __init__(
        self,
        config: DictConfig,
        tokenizer,
        train_dataloader,
        val_dataloader,
        reward_fn,
        val_reward_fn,
        tracker=None,
        worker_groups: WorkerGroups | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.train_dataloader = train_dataloader
        self.val_dataloader = val_dataloader
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.tracker = tracker
        self.use_critic = need_critic(config)
        self.use_reference = need_reference(config)
        self.kl_ctrl = get_kl_controller(**_kl_ctrl_kwargs(config.algorithm.kl_ctrl))
        self.group_filter = (
            GroupFilter(config.algorithm.filter_groups) if config.algorithm.filter_groups.enable else None
        )
        self.total_training_steps = total_training_steps(config, len(train_dataloader))
        set_optim_total_steps(config, self.total_training_steps)
        self.global_steps = 0
        self.wg = worker_groups
        self.checkpointer = TrainerCheckpointer(config.trainer)
        self.stop = StopRequest()  # entered by run_ppo: SIGTERM/SIGINT finish the step, save, stop
        self.reward_extra_keys: set[str] = set()  # per-sample reward extras seen (for generation dumps)
        self.reward_loop_metrics: dict[str, float] = {}  # the reward loop's, since the last step's log
        self.use_greedy_baseline = config.algorithm.adv_estimator in ESTIMATORS_NEEDING_GREEDY_BASELINE
        # rollout.use_rollout_log_probs: whether (and when) the engine's log-probs last matched a recompute
        self.log_prob_parity = LogProbParity()
        self.old_log_probs_from_update = update_computes_old_log_probs(config)
        self.concurrent_phases = bool(config.trainer.get("concurrent_phases", True))
        self.rollout_manager = None  # rollout.mode=async: the agent loops' servers and workers
        self.rollout_correction = RolloutCorrection.from_config(config.algorithm.get("rollout_correction"))
        self.rollout_backend = str(config.actor_rollout_ref.rollout.name)
        self.log_prob_gap_limit = gap_limit(config.actor_rollout_ref.rollout, computes_in_fp32(config))
        self.step_profiler = StepProfiler(config)  # global_profiler: verl's profiler around the chosen steps

    # ------------------------------------------------------------------ setup
    def init_workers(self) -> None:
        """Spawn the worker groups (one process per device of each pool) and load the models."""
        if self.wg is None:
            self.wg = build_worker_groups(self.config, self.use_critic, self.use_reference)
        self.wg.init_models(total_training_steps=self.total_training_steps)
        for line in self.wg.describe():
            print(f"hybridflow: {line}", flush=True)
        if self.config.actor_rollout_ref.rollout.get("mode", "sync") == "async":
            from hybridflow.workers.rollout.agent_loop.manager import AgentLoopManager

            self.rollout_manager = AgentLoopManager(self.config, self.wg.actor_rollout)

    @property
    def rollout(self):
        """What ``generate_sequences`` goes to: the agent-loop manager (``rollout.mode=async``) or the
        actor/rollout worker group (sync)."""
        return self.rollout_manager if self.rollout_manager is not None else self.wg.actor_rollout

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train until ``total_training_steps``; returns the last step's metrics."""
        from tqdm import tqdm

        self.global_steps = self.checkpointer.load(self)
        if self.tracker is not None:  # records an interrupted attempt logged past the checkpoint
            self.tracker.rewind(self.global_steps)
        if self.config.trainer.val_before_train and self.val_reward_fn is not None and self.global_steps == 0:
            self._log(self.validate(), step=0)
            if self.config.trainer.val_only:
                return {}
        progress = tqdm(
            total=self.total_training_steps,
            initial=self.global_steps,
            desc="training",
            disable=not self.config.trainer.get("progress_bar", True),
            dynamic_ncols=True,
        )
        metrics: dict[str, float] = {}
        data_iter = self._batches()
        start, first_step = time.monotonic(), self.global_steps
        for line in self.step_profiler.describe(self.total_training_steps):
            print(f"hybridflow: {line}", flush=True)
        while self.global_steps < self.total_training_steps and not self.stop.requested:
            self.global_steps += 1
            self.step_profiler.begin(self.global_steps, self.wg)
            metrics = self.fit_step(data_iter)
            metrics.update(self.after_update())
            self.step_profiler.end(self.global_steps)
            self._stop_when_out_of_time(time.monotonic() - start, self.global_steps - first_step, progress)
            if self._is_due(self.config.trainer.test_freq) and self.val_reward_fn is not None:
                if not self.stop.requested:  # preempted: the grace period is for the save
                    testing: dict[str, float] = {}
                    with marked_timer("testing", testing):  # verl's name; outside timing_s/step here
                        metrics.update(self.validate())
                    metrics["timing_s/testing"] = testing["testing"]
            self._log(metrics, step=self.global_steps)  # first: a save that fails keeps the step's metrics
            if self._is_due(self.config.trainer.save_freq) or self._save_on_preempt():
                self.checkpointer.save(self)
            progress.set_postfix(score=f"{metrics.get('critic/score/mean', float('nan')):.3f}")
            progress.update(1)
        progress.close()
        self.step_profiler.close(self.global_steps)  # a continuous profile cut short by the end of training
        if self.stop.requested:
            raise TrainingPreempted(self.stop.signum, self.global_steps, self.checkpointer.latest(), False)
        return metrics

    def fit_step(self, data_iter) -> dict[str, float]:
        """One RL step: the dataflow of the HybridFlow paper, phase by phase."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with marked_timer("step", timing):
            with marked_timer("gen", timing):
                batch = self.collect_rollouts(data_iter, metrics, timing)
            if self.config.trainer.balance_batch:
                self.balance_batch(batch, metrics)
            batch.meta_info["global_token_num"] = batch.batch[keys.ATTENTION_MASK].sum(dim=-1).tolist()
            # reward, old/reference log-probs and values read only the rollout: issued together
            batch = self.prepare_experience(batch, metrics, timing)
            with marked_timer("adv", timing):
                batch = self.compute_advantage(batch, metrics)
            # the critic and the actor update read the same advantages and nothing of each other
            metrics.update(self.update_models(batch, timing))
        check_log_prob_gap(metrics, self.log_prob_gap_limit, self.global_steps, self.rollout_backend)
        self.dump_rollouts(batch)
        batch.meta_info["max_prompt_length"] = int(self.config.data.max_prompt_length)
        metrics.update(metric_utils.compute_data_metrics(batch, use_critic=self.use_critic))
        metrics.update(metric_utils.compute_timing_metrics(batch, timing))
        metrics.update(
            metric_utils.compute_throughput_metrics(batch, timing, n_workers=self.wg.total_workers)
        )
        metrics.update(metric_utils.compute_overhead_metrics(timing, metrics))
        metrics.update(self.reward_loop_metrics)
        self.reward_loop_metrics = {}
        metrics.update(self.wg.mfu_metrics(batch, timing, metrics))
        metrics["training/global_step"] = self.global_steps
        return metrics

    # ------------------------------------------------------------------ phases
    def collect_rollouts(self, data_iter, metrics: dict, timing: dict) -> DataProto:
        """Generate ``rollout.n`` responses per prompt. With DAPO dynamic sampling they are scored
        here, and generation goes on until enough prompt groups have non-zero reward variance;
        otherwise scoring is one of :meth:`prepare_experience`'s phases."""
        if self.group_filter is None:
            return self.generate_with_baselines(next(data_iter), metrics, timing)
        return self.group_filter.fill(
            self.generate_and_score(next(data_iter), metrics, timing),
            lambda: self.generate_and_score(next(data_iter), metrics, timing),
            self.config.data.train_batch_size,
            metrics,
        )

    def generate_and_score(self, prompts: DataProto, metrics: dict, timing: dict) -> DataProto:
        """Generate and score one batch of prompts."""
        return self.compute_reward(self.generate_with_baselines(prompts, metrics, timing), metrics, timing)

    def generate_with_baselines(self, prompts: DataProto, metrics: dict, timing: dict) -> DataProto:
        """Generate one batch of prompts; ReMax also scores a greedy response per prompt."""
        baselines = None
        if self.use_greedy_baseline:
            baselines = self.greedy_reward_baselines(prompts, timing, metrics)
        batch = self.generate(prompts, timing, metrics)
        if baselines is not None:
            batch.batch[keys.REWARD_BASELINES] = baselines
        return batch

    def generate(self, prompts: DataProto, timing: dict, metrics: dict | None = None) -> DataProto:
        """Prompts (B) → B x n rows of prompt + response; rows of one prompt share a ``uid``.
        Sampling follows the rollout config (``do_sample=false``: greedy)."""
        n = int(self.config.actor_rollout_ref.rollout.n)
        meta = {"global_steps": self.global_steps, "epoch": int(prompts.meta_info.get("epoch", 0))}
        meta.update(chat_template_meta(self.config))
        return rollout_with_uids(self.rollout, prompts, n, meta, timing, metrics)

    def greedy_reward_baselines(self, prompts: DataProto, timing: dict, metrics: dict) -> torch.Tensor:
        """``reward_baselines`` (B x n,): the sequence reward of one greedy response per prompt
        (ReMax, Li et al. 2023, arXiv 2310.10505; verl's ``gen_max`` step), repeated for the prompt's
        ``n`` rows. The greedy rows are scored like the training rows (reward model, then the reward
        function) and then dropped."""
        with marked_timer("gen_max", timing):
            # B prompts need not divide the workers (B x n does): pad for the dispatch
            meta = {"global_steps": self.global_steps, "do_sample": False, AUTO_PADDING_KEY: True}
            meta.update(chat_template_meta(self.config))
            # a copy of the prompts: rollout_with_uids tags them with uids
            greedy = rollout_with_uids(self.rollout, prompts.select(), 1, meta, timing, metrics)
            greedy = self.compute_reward(greedy, {}, timing={})
        baselines = greedy.batch[keys.TOKEN_LEVEL_SCORES].sum(dim=-1)
        return baselines.repeat_interleave(int(self.config.actor_rollout_ref.rollout.n))

    def compute_reward(self, batch: DataProto, metrics: dict, timing: dict) -> DataProto:
        """``token_level_scores`` (B, T_r): reward-model scores and/or the rule reward function (not again
        when the agent loops scored each sample as it finished)."""
        if keys.TOKEN_LEVEL_SCORES not in batch.batch.keys():
            run_phases([self.reward_phase(batch)], timing, concurrent=False)
        return batch

    def reward_phase(self, batch: DataProto) -> Phase:
        """Sets ``token_level_scores`` (and per-sample extras) on ``batch``: the reward model's scores
        (a worker call) when enabled, else the rule reward function (run on the driver)."""
        if not reward_model_worker(self.config):  # (a served RM: the reward loop calls it in _score)
            return Phase("reward", run=lambda: self._score(batch))
        rm = self.wg.reward_model
        return Phase(
            "reward",
            issue=lambda: rm.compute_rm_score_async(batch),
            finish=lambda out: self._score(batch.union(out)),
        )

    def _score(self, batch: DataProto) -> None:
        start = time.perf_counter()
        result = self.reward_fn(batch, return_dict=True)
        if hasattr(self.reward_fn, "pop_metrics"):  # the reward loop, after the rollout: all of it exposed
            self.reward_loop_metrics.update(self.reward_fn.pop_metrics())
            self.reward_loop_metrics["reward/exposed_s"] = time.perf_counter() - start
        batch.batch[keys.TOKEN_LEVEL_SCORES] = result["reward_tensor"]
        for key, values in result.get("reward_extra_info", {}).items():
            if len(values) == len(batch):  # per-sample extras (acc, pred, ...) travel with the batch
                batch.non_tensor_batch[key] = _object_array(values)
                self.reward_extra_keys.add(key)

    def balance_batch(self, batch: DataProto, metrics: dict) -> None:
        """Reorder rows so every dp rank gets a similar number of tokens (in place). The responses to
        one prompt stay together on one rank when the groups divide evenly over the ranks, so the
        workers can compute each shared prompt once (:mod:`hybridflow.workers.shared_prefix`)."""
        seqlens = batch.batch[keys.ATTENTION_MASK].sum(dim=-1).tolist()
        parts = group_balanced_partitions(batch.non_tensor_batch[keys.UID], seqlens, self.wg.world_size)
        if parts is None:
            parts = get_seqlen_balanced_partitions(seqlens, k_partitions=self.wg.world_size, equal_size=True)
        batch.reorder(torch.tensor([i for part in parts for i in part]))
        metrics.update(log_seqlen_unbalance(seqlens, parts, prefix="global_seqlen"))

    def prepare_experience(self, batch: DataProto, metrics: dict, timing: dict) -> DataProto:
        """``token_level_scores`` (unless the rollout was scored already), ``old_log_probs``,
        ``ref_log_prob`` and ``values``: each reads only the rollout, so they are issued together and
        overlap when their roles are on different pools (``trainer.concurrent_phases``)."""
        phases = [self.old_log_prob_phase(batch, metrics)]
        if self.use_reference:
            phases.append(Phase("ref", issue=lambda: self.wg.ref.compute_ref_log_prob_async(batch)))
        if self.use_critic:
            phases.append(Phase("values", issue=lambda: self.wg.critic.compute_values_async(batch)))
        if keys.TOKEN_LEVEL_SCORES not in batch.batch.keys():
            phases.append(self.reward_phase(batch))
        for output in run_phases([p for p in phases if p is not None], timing, self.concurrent_phases):
            if isinstance(output, DataProto):
                batch.union(output)
        if self.rollout_correction is not None and not self.rollout_correction.bypass_mode:
            self.correct_for_the_rollout(batch, metrics)
        return batch

    def correct_for_the_rollout(self, batch: DataProto, metrics: dict) -> None:
        """``algorithm.rollout_correction`` (decoupled mode): IS weights π_old / π_rollout for the policy
        loss and the rejection mask, from the recomputed ``old_log_probs`` and the rollout's own."""
        from hybridflow.algorithms.rollout_correction import correct

        if keys.ROLLOUT_LOG_PROBS not in batch.batch.keys():
            raise ValueError(
                "algorithm.rollout_correction needs the rollout's log-probs: rollout.calculate_log_probs=true"
            )
        weights, mask, found = correct(
            batch.batch[keys.OLD_LOG_PROBS],
            batch.batch[keys.ROLLOUT_LOG_PROBS],
            batch.batch[keys.RESPONSE_MASK],
            self.rollout_correction,
        )
        if weights is not None:
            batch.batch[keys.ROLLOUT_IS_WEIGHTS] = weights
        batch.batch[keys.RESPONSE_MASK] = mask
        metrics.update(found)

    def compute_old_log_prob(self, batch: DataProto, metrics: dict) -> DataProto:
        """``old_log_probs`` (see :meth:`old_log_prob_phase`), waited for."""
        phase = self.old_log_prob_phase(batch, metrics)
        return batch if phase is None else batch.union(run_phases([phase], {}, concurrent=False)[0])

    def old_log_prob_phase(self, batch: DataProto, metrics: dict) -> Phase | None:
        """``old_log_probs`` from a forward pass of the actor — or, with ``rollout.use_rollout_log_probs``,
        the rollout's own log-probs (one forward pass saved) while they are trusted: they matched that
        forward within ``rollout.log_prob_parity_tolerance`` at a check made fewer than
        ``rollout.log_prob_parity_check_freq`` steps ago. A failed check keeps the recompute (and checks
        again every step until a check passes). None when no forward is needed (set in place)."""
        if self.old_log_probs_from_update:  # see update_computes_old_log_probs: no forward needed
            return None
        rollout_log_probs = batch.batch.get(keys.ROLLOUT_LOG_PROBS, None)
        if self.rollout_correction is not None and self.rollout_correction.bypass_mode:
            if rollout_log_probs is None:
                raise ValueError("rollout_correction.bypass_mode needs rollout.calculate_log_probs=true")
            batch.batch[keys.OLD_LOG_PROBS] = rollout_log_probs.clone()  # π_old := π_rollout, no forward
            return None
        rollout_cfg = self.config.actor_rollout_ref.rollout
        use_rollout = bool(rollout_cfg.get("use_rollout_log_probs", False)) and rollout_log_probs is not None
        check_freq = int(rollout_cfg.get("log_prob_parity_check_freq", 10))
        if use_rollout and self.log_prob_parity.trusted(self.global_steps, check_freq):
            batch.batch[keys.OLD_LOG_PROBS] = rollout_log_probs.clone()
            return None
        return Phase(
            "old_log_prob",
            issue=lambda: self.wg.actor_rollout.compute_log_prob_async(batch),
            finish=lambda output: self._old_log_probs(batch, output, metrics, use_rollout),
        )

    def _old_log_probs(
        self, batch: DataProto, output: DataProto, metrics: dict, use_rollout: bool
    ) -> DataProto:
        """``old_log_probs`` of the actor's forward; entropy and rollout-parity metrics on the side."""
        rollout_cfg = self.config.actor_rollout_ref.rollout
        rollout_log_probs = batch.batch.get(keys.ROLLOUT_LOG_PROBS, None)
        entropys = output.pop(batch_keys=["entropys"]).batch["entropys"]
        response_mask = batch.batch[keys.RESPONSE_MASK]
        metrics["actor/entropy"] = float(masked_mean(entropys, response_mask.float()))
        if rollout_log_probs is not None:
            old_log_probs = output.batch[keys.OLD_LOG_PROBS]
            parity = metric_utils.rollout_parity_metrics(rollout_log_probs, old_log_probs, response_mask)
            metrics.update(parity)
            tolerance = parity_tolerance(rollout_cfg)
            if use_rollout:
                matched = parity["training/rollout_log_probs_diff_max"] <= tolerance
                self.log_prob_parity = LogProbParity(verified=matched, checked_at=self.global_steps)
                metrics["training/rollout_log_probs_verified"] = float(matched)
        kept = [keys.OLD_LOG_PROBS]
        if keys.ROUTED_EXPERTS in output.batch.keys():  # router_replay.mode=R2: the update replays these
            if keys.ROUTED_EXPERTS in batch.batch.keys():  # as verl: R2 keeps the recorded, not the rollout's
                batch.pop(batch_keys=[keys.ROUTED_EXPERTS])
            kept.append(keys.ROUTED_EXPERTS)
        return output.select(batch_keys=kept, meta_info_keys=[])

    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        return batch.union(self.wg.ref.compute_ref_log_prob(batch))

    def compute_values(self, batch: DataProto) -> DataProto:
        return batch.union(self.wg.critic.compute_values(batch))

    def compute_advantage(self, batch: DataProto, metrics: dict) -> DataProto:
        """Rewards (optionally minus an in-reward KL penalty), then the registered estimator."""
        algo = self.config.algorithm
        response_mask = batch.batch[keys.RESPONSE_MASK]
        scores = batch.batch[keys.TOKEN_LEVEL_SCORES]
        if algo.use_kl_in_reward:
            rewards, current_kl = apply_kl_penalty_to_rewards(
                scores,
                batch.batch[keys.OLD_LOG_PROBS],
                batch.batch[keys.REF_LOG_PROB],
                response_mask,
                self.kl_ctrl.value,
                algo.kl_penalty,
            )
            metrics.update(
                {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": self.kl_ctrl.value}
            )
            self.kl_ctrl.update(current_kl, n_steps=len(batch))
        else:
            rewards = scores
        batch.batch[keys.TOKEN_LEVEL_REWARDS] = rewards
        inputs = AdvantageInputs(
            token_level_rewards=rewards,
            response_mask=response_mask,
            index=batch.non_tensor_batch[keys.UID],
            values=batch.batch.get(keys.VALUES, None),
            reward_baselines=batch.batch.get(keys.REWARD_BASELINES, None),
            gamma=float(algo.gamma),
            lam=float(algo.lam),
            norm_adv_by_std_in_grpo=bool(algo.norm_adv_by_std_in_grpo),
            config=algo,
        )
        advantages, returns = compute_advantage(algo.adv_estimator, inputs)
        batch.batch[keys.ADVANTAGES] = advantages
        batch.batch[keys.RETURNS] = returns
        return batch

    def update_models(self, batch: DataProto, timing: dict) -> dict[str, float]:
        """The critic's and the actor's updates (the actor's after ``trainer.critic_warmup`` steps),
        issued together: they overlap when the critic has a pool of its own."""
        batch.meta_info["global_steps"] = self.global_steps  # the temperature: the worker's config
        phases = []
        if self.use_critic:
            phases.append(Phase("update_critic", lambda: self.wg.critic.update_critic_async(batch), _reduced))
        if self.global_steps > self.config.trainer.critic_warmup:
            phases.append(
                Phase("update_actor", lambda: self.wg.actor_rollout.update_actor_async(batch), _reduced)
            )
        metrics: dict[str, float] = {}
        for result in run_phases(phases, timing, self.concurrent_phases):
            metrics.update(result)
        return metrics

    def update_critic(self, batch: DataProto) -> dict[str, float]:
        batch.meta_info["global_steps"] = self.global_steps
        return _reduced(self.wg.critic.update_critic(batch))

    def update_actor(self, batch: DataProto) -> dict[str, float]:
        batch.meta_info["global_steps"] = self.global_steps  # the temperature: the worker's config
        return _reduced(self.wg.actor_rollout.update_actor(batch))

    def dump_rollouts(self, batch: DataProto) -> None:
        """``trainer.rollout_data_dir``: this step's generations as ``{dir}/{step}.jsonl`` (verl's dump)."""
        from hybridflow.trainer.ppo.generations import dump_rollouts

        dump_rollouts(self, batch)

    def after_update(self) -> dict[str, float]:
        """Hook after each step's update, before validation and the save (the asynchronous trainer
        moves its weights to the rollouter here). Returns metrics for the step."""
        return {}

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy (``val_kwargs``) generation on the validation set, scored by the reward function."""
        from hybridflow.trainer.ppo.validation import run_validation

        return run_validation(self)

    # ------------------------------------------------------------------ helpers
    def _stop_when_out_of_time(self, elapsed_s: float, steps_done: int, progress) -> None:
        """``trainer.time_budget_minutes``: make this step the last one (validated and saved as
        such) when another step of the mean length would not fit in the budget."""
        budget = self.config.trainer.get("time_budget_minutes")
        if budget and out_of_time(elapsed_s, steps_done, float(budget) * 60):
            if self.global_steps < self.total_training_steps:
                print(f"time budget of {budget} min reached after step {self.global_steps}: stopping")
                self.total_training_steps = self.global_steps
                progress.total = self.global_steps

    def _batches(self):
        """Training batches across epochs, resuming mid-epoch from the loader's state; each carries its
        epoch (the samples' sampling streams depend on it)."""
        while True:
            epoch = int(getattr(self.train_dataloader, "epoch", 0))
            for batch_dict in self.train_dataloader:
                yield DataProto.from_single_dict(batch_dict, meta_info={"epoch": epoch})

    def _save_on_preempt(self) -> bool:
        return self.stop.requested and bool(self.config.trainer.get("save_on_preempt", True))

    def _is_due(self, freq) -> bool:
        freq = int(freq or -1)
        last = self.global_steps == self.total_training_steps
        return freq > 0 and (self.global_steps % freq == 0 or last)

    def _log(self, metrics: dict, step: int) -> None:
        if self.tracker is not None and metrics:
            self.tracker.log(data=metrics, step=step)


@dataclass(frozen=True)
class LogProbParity:
    """``rollout.use_rollout_log_probs``: did the rollout's log-probs match the actor's recompute at
    the last check, made at step ``checked_at`` (0: never)? Saved in the trainer checkpoint, so a
    resumed run trusts (or re-checks) exactly when the uninterrupted one would."""

    verified: bool = False
    checked_at: int = 0

    def trusted(self, step: int, check_freq: int) -> bool:
        """Use the rollout's log-probs at ``step``: verified, and the check is not yet due again."""
        return self.verified and step - self.checked_at < check_freq


def _reduced(output: DataProto) -> dict[str, float]:
    """An update's metrics (lists over micro-batches and ranks) reduced to numbers."""
    return metric_utils.reduce_metrics(output.meta_info["metrics"])


def _object_array(values) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def _kl_ctrl_kwargs(kl_ctrl) -> dict:
    return {
        "kl_ctrl_type": kl_ctrl.type,
        "kl_coef": float(kl_ctrl.kl_coef),
        "target_kl": float(kl_ctrl.target_kl),
        "horizon": int(kl_ctrl.horizon),
    }


def out_of_time(elapsed_s: float, steps_done: int, budget_s: float) -> bool:
    """Whether one more step, as long as the mean step so far, would end past ``budget_s``."""
    return steps_done > 0 and elapsed_s + elapsed_s / steps_done > budget_s


def group_balanced_partitions(uids, seqlens: list[int], world: int) -> list[list[int]] | None:
    """Row indices per rank, balanced by tokens, keeping each uid group whole; None when the groups
    are not all the same size or do not divide evenly over ``world`` ranks (equal rows per rank)."""
    groups: dict = {}
    for row, uid in enumerate(uids):
        groups.setdefault(uid, []).append(row)
    members = list(groups.values())
    if len({len(m) for m in members}) != 1 or len(members) % world:
        return None
    tokens = [sum(seqlens[i] for i in m) for m in members]
    parts = get_seqlen_balanced_partitions(tokens, k_partitions=world, equal_size=True)
    return [sorted(i for g in part for i in members[g]) for part in parts]


def set_optim_total_steps(config: DictConfig, total_steps: int) -> None:
    """Give the actor's and critic's lr schedules the run's length (verl does the same): one scheduler
    step per training step, so a cosine decays over the run and a warmup ratio means something."""
    config.actor_rollout_ref.actor.optim.total_training_steps = int(total_steps)
    config.critic.optim.total_training_steps = int(total_steps)


def total_training_steps(config: DictConfig, batches_per_epoch: int) -> int:
    if config.trainer.get("total_training_steps"):
        return int(config.trainer.total_training_steps)
    return batches_per_epoch * int(config.trainer.total_epochs)


def computes_in_fp32(config: DictConfig) -> bool:
    """Whether the rollout and the actor's log-prob recompute both run in fp32 (then their log-probs
    agree to rounding, and a gap beyond 1e-2 means different weights)."""
    from hybridflow.workers.fsdp_utils import compute_dtype
    from hybridflow.workers.rollout.engine_rollout import engine_dtype

    device = str(config.trainer.device)
    rollout = engine_dtype(config.actor_rollout_ref.rollout.get("dtype"), device)
    actor = compute_dtype(config.actor_rollout_ref.actor.fsdp_config, device)
    return rollout == torch.float32 and actor == torch.float32
