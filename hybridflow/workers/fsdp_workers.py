"""FSDP2 workers: the hybrid actor/rollout/reference worker and the critic worker.

Each method the controller calls is declared with its distribution (``@register``): data methods
dispatch by the data-parallel rank of their model's mesh (``actor``, ``ref``, ``rollout``, ``critic``:
the ranks of one tensor-parallel group get the same shard and only its first rank's output is
collected; without tensor parallelism every rank is its own dp rank, as ``DP_COMPUTE_PROTO``),
lifecycle methods are ``ONE_TO_ALL``. Each worker receives only its own config section
(``actor_rollout_ref`` or ``critic``), already resolved by the trainer.

Tensor parallelism: ``actor.tensor_model_parallel_size`` / ``ref.tensor_model_parallel_size`` /
``critic.tensor_model_parallel_size`` t train on a (world / t, t) mesh
(:mod:`hybridflow.workers.tensor_parallel`); ``rollout.tensor_model_parallel_size`` t_g generates in
groups of t_g ranks formed from the actor's micro-DP groups (:mod:`.rollout.engine.reshard`).
"""

from __future__ import annotations

import time

from omegaconf import DictConfig, OmegaConf, open_dict

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, make_nd_compute_dataproto_dispatch_fn, register
from hybridflow.utils.dataset.multimodal import load_processor
from hybridflow.utils.profiler import WorkerProfiler, annotate
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
from hybridflow.workers.checkpoint_engine.manager import CheckpointEngineWorker
from hybridflow.workers.critic.dp_critic import DataParallelPPOCritic
from hybridflow.workers.forward import tally_forwards
from hybridflow.workers.fsdp_utils import build_device_mesh
from hybridflow.workers.lora import adapter_disabled, lora_enabled, unwrap_peft
from hybridflow.workers.model_builder import build_fsdp_module, build_training_parts, resolve_local_path
from hybridflow.workers.rollout.base import get_rollout_cls
from hybridflow.workers.rollout.engine.parallel import SINGLE, GenerationShard
from hybridflow.workers.rollout.engine.reshard import ReshardLayout
from hybridflow.workers.ulysses import configured_sp_size, enable_sequence_parallel, scale_token_budgets

ROLES = ("actor", "rollout", "ref", "actor_ref", "actor_rollout", "actor_rollout_ref")

# Data methods dispatch by the dp rank each worker declares for its model's mesh (register_meshes).
ACTOR_DISPATCH = make_nd_compute_dataproto_dispatch_fn("actor")
REF_DISPATCH = make_nd_compute_dataproto_dispatch_fn("ref")
ROLLOUT_DISPATCH = make_nd_compute_dataproto_dispatch_fn("rollout")
CRITIC_DISPATCH = make_nd_compute_dataproto_dispatch_fn("critic")


def _tp_size(section) -> int:
    """A section's ``tensor_model_parallel_size`` (1 when absent or null)."""
    return int(section.get("tensor_model_parallel_size") or 1)


def _own_copy(config) -> DictConfig:
    """A private, mutable, fully resolved copy of a config section."""
    return OmegaConf.create(OmegaConf.to_container(config, resolve=True))


def _per_rank(total: int | None, world_size: int, what: str) -> int | None:
    if total is None:
        return None
    if total % world_size:
        raise ValueError(f"{what}={total} is not divisible by the {world_size} worker processes")
    return total // world_size


def set_total_training_steps(optim_cfg: DictConfig, total_training_steps: int | None) -> None:
    """Give an ``optim`` section the run's number of training steps (one scheduler step each), so a
    cosine decays over the run and a warmup ratio means something. The trainer knows it only once its
    data is loaded, while this worker is already starting, so it arrives with ``init_model`` rather
    than with the config the worker was built with. None keeps the section's own value."""
    if total_training_steps is not None:
        with open_dict(optim_cfg):
            optim_cfg.total_training_steps = int(total_training_steps)


def _mean_metrics(metrics: dict[str, list]) -> dict[str, float]:
    return {k: float(sum(v) / len(v)) for k, v in metrics.items() if v}


def _memory_metrics() -> dict[str, float]:
    # perf/cpu_peak_rss_gb: the worker process's peak resident set. Not verl's perf/cpu_memory_used_gb,
    # which is the whole host's used memory at the time of the call. On CUDA also the allocator's peaks.
    from hybridflow.utils.device import memory_metrics

    return memory_metrics()


def _checkpoint_manager(parts, tokenizer, contents, trainable_only: bool = False):
    from hybridflow.utils.checkpoint import FSDPCheckpointManager

    return FSDPCheckpointManager(
        parts.module,
        parts.optimizer,
        parts.lr_scheduler,
        processing_class=tokenizer,
        checkpoint_contents=tuple(contents),
        trainable_only=trainable_only,
    )


def generation_shard(layout: ReshardLayout, rank: int) -> GenerationShard:
    """``rank``'s place in its generation group. Creating the groups is a collective: every rank
    creates every group, in the same order."""
    if layout.gen_tp == 1:
        return SINGLE
    import torch.distributed as dist

    mine = SINGLE
    for ranks in layout.gen_groups():  # ordered by shard
        group = dist.new_group(ranks)
        if rank in ranks:
            members = tuple(ranks.index(r) for r in sorted(ranks))
            mine = GenerationShard(ranks.index(rank), layout.gen_tp, group, members)
    return mine


class FSDPWorkerBase(Worker):
    """Process group, device mesh and checkpointing shared by the FSDP workers."""

    def __init__(self) -> None:
        super().__init__()
        self.init_process_group()
        self.device_mesh = build_device_mesh(self.world_size, self.device_type())
        self._tp_meshes = {}
        # Pure data parallelism: every rank is its own dp rank and is collected.
        self.register_dispatch_collect_info("dp", dp_rank=self.rank, is_collect=True)
        self.checkpoint_manager = None
        # transformers' auto-model classes take ~1 s to import: do it while the driver still loads its
        # data (worker creation does not wait for this), not later in init_model.
        from transformers import AutoModelForCausalLM  # noqa: F401

    # ------------------------------------------------------------------ verl's profiler (utils/profiler.py)
    def profiled_roles(self) -> tuple[str, ...]:
        """The profiler roles (``actor``, ``rollout``, ``ref``, ``critic``) this worker holds."""
        return ()

    @property
    def profiler(self) -> WorkerProfiler:
        """This worker's :class:`~hybridflow.utils.profiler.WorkerProfiler` (made on first use)."""
        if getattr(self, "_profiler", None) is None:
            self._profiler = WorkerProfiler(self.rank, self.profiled_roles(), self.device_type())
        return self._profiler

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, profile_step: int, profiles: dict) -> list[str]:
        """Begin profiling step ``profile_step`` for this worker's roles in ``profiles`` (role ->
        :class:`~hybridflow.utils.profiler.RoleProfile`) whose ranks include this one."""
        return self.profiler.start(profile_step, profiles)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self, profile_step: int | None = None) -> list[str]:
        """End the profile (``profile_step``: the last step it covers); returns the files written here."""
        return self.profiler.stop(profile_step)

    def mesh(self, tensor_parallel_size: int):
        """The device mesh of a model trained with ``tensor_model_parallel_size`` (built once)."""
        if tensor_parallel_size <= 1:
            return self.device_mesh
        if tensor_parallel_size not in self._tp_meshes:
            self._tp_meshes[tensor_parallel_size] = build_device_mesh(
                self.world_size, self.device_type(), tensor_parallel_size
            )
        return self._tp_meshes[tensor_parallel_size]

    def _sequence_parallel(self, module, sp: int):
        """``module`` split over Ulysses groups of ``sp`` ranks (unchanged when sp is 1)."""
        return enable_sequence_parallel(module, sp, self.world_size, self.device_type())

    def register_tp_dispatch(self, mesh_name: str, tensor_parallel_size: int) -> int:
        """Declare this rank's dp rank on ``mesh_name`` (TP groups: consecutive ranks; the first one is
        collected); returns the dp degree."""
        if self.world_size % tensor_parallel_size:
            raise ValueError(
                f"{mesh_name}: tensor_model_parallel_size={tensor_parallel_size} does not divide the "
                f"{self.world_size} worker processes"
            )
        dp_rank, tp_rank = divmod(self.rank, tensor_parallel_size)
        self.register_dispatch_collect_info(mesh_name, dp_rank=dp_rank, is_collect=tp_rank == 0)
        return self.world_size // tensor_parallel_size

    def _manager(self):
        if self.checkpoint_manager is None:
            raise RuntimeError(
                f"{type(self).__name__} has no trainable model to checkpoint (call init_model first)"
            )
        return self.checkpoint_manager

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(
        self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None
    ) -> None:
        """Sharded model + optimizer + scheduler + RNG states into ``local_path`` (collective, atomic)."""
        self._manager().save_checkpoint(local_path, global_step, max_ckpt_to_keep=max_ckpt_to_keep)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        self._manager().load_checkpoint(local_path)
        self._rollout_weights_stale = getattr(self, "_is_rollout", False)


class ActorRolloutRefWorker(CheckpointEngineWorker, FSDPWorkerBase):
    """One process of the hybrid engine. ``role`` picks what it holds: the trainable actor, the
    rollout that generates with the actor's own weights, and/or the frozen reference policy."""

    def __init__(self, config, role: str = "actor_rollout_ref") -> None:
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {ROLES}")
        self.config = _own_copy(config)
        self.role = role
        self._is_actor = role in ("actor", "actor_ref", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_ref", "actor_rollout_ref")
        self.actor_tp = _tp_size(self.config.actor)
        self.ref_tp = _tp_size(self.config.ref)
        # Ulysses: groups of sp consecutive ranks share rows, as TP groups do (hybridflow.workers.ulysses)
        self.actor_sp = configured_sp_size(self.config.actor, self.config.actor.get("fsdp_config"))
        self.ref_sp = configured_sp_size(self.config.ref, self.config.ref.get("fsdp_config"))
        self.rollout_tp = _tp_size(self.config.rollout)
        self._register_meshes()
        self._normalise_batch_sizes()

    def profiled_roles(self) -> tuple[str, ...]:
        held = (("actor", self._is_actor), ("rollout", self._is_rollout), ("ref", self._is_ref))
        return tuple(role for role, here in held if here)

    def _register_meshes(self) -> None:
        """The dp rank of this process on each mesh its role uses (the data methods dispatch by it)."""
        self.dp = {}
        if self._is_actor or self._is_rollout:  # the rollout role computes the actor's log-probs too
            self.dp["actor"] = self.register_tp_dispatch("actor", self.actor_tp * self.actor_sp)
        if self._is_ref:
            self.dp["ref"] = self.register_tp_dispatch("ref", self.ref_tp * self.ref_sp)
        self.layout = None
        if self._is_rollout:
            self.layout = ReshardLayout(self.world_size, self.actor_tp, self.rollout_tp)
            gen_dp, gen_rank = self.layout.gen_coords(self.rank)
            self.register_dispatch_collect_info("rollout", dp_rank=gen_dp, is_collect=gen_rank == 0)

    def _normalise_batch_sizes(self) -> None:
        """Config batch sizes are global prompts (verl); each model works in responses per dp rank."""
        cfg, dp = self.config, self.dp
        scale_token_budgets(cfg.actor, self.actor_sp, ("ppo_max_token_len_per_gpu",))
        scale_token_budgets(cfg.rollout, self.actor_sp, ("log_prob_max_token_len_per_gpu",))
        scale_token_budgets(cfg.ref, self.ref_sp, ("log_prob_max_token_len_per_gpu",))
        with open_dict(cfg):
            if self._is_actor:
                responses = int(cfg.actor.ppo_mini_batch_size) * int(cfg.rollout.n)
                cfg.actor.ppo_mini_batch_size = _per_rank(
                    responses, dp["actor"], "ppo_mini_batch_size x rollout.n"
                )
                if cfg.actor.get("ppo_micro_batch_size"):
                    cfg.actor.ppo_micro_batch_size_per_gpu = _per_rank(
                        int(cfg.actor.ppo_micro_batch_size), dp["actor"], "actor.ppo_micro_batch_size"
                    )
            # rollout.log_prob_*: the actor's own log-prob pass
            for section, model in (("ref", "ref"), ("rollout", "actor")):
                if model in dp and cfg[section].get("log_prob_micro_batch_size"):
                    cfg[section].log_prob_micro_batch_size_per_gpu = _per_rank(
                        int(cfg[section].log_prob_micro_batch_size),
                        dp[model],
                        f"{section}.log_prob_micro_batch_size",
                    )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int | None = None) -> None:
        """Load the role's models. ``total_training_steps``: the run's length, for the actor's lr
        schedule (see :func:`set_total_training_steps`)."""
        from hybridflow.models.loading import get_generation_eos_ids, load_tokenizer

        cfg = self.config
        if self._is_actor:
            set_total_training_steps(cfg.actor.optim, total_training_steps)
        self.tokenizer = load_tokenizer(
            resolve_local_path(cfg.model.path),
            trust_remote_code=cfg.model.get("trust_remote_code", False),
            custom_chat_template=cfg.model.get("custom_chat_template"),
        )
        self.eos_token_ids = get_generation_eos_ids(
            resolve_local_path(cfg.model.path), trust_remote_code=cfg.model.get("trust_remote_code", False)
        )
        if self._is_actor:
            self.actor_parts = build_training_parts(
                cfg.model,
                cfg.actor.fsdp_config,
                cfg.actor.optim,
                self.mesh(self.actor_tp),
                freeze_vision=bool(cfg.actor.get("freeze_vision_tower", False)),
            )
            self.actor_module = self._sequence_parallel(self.actor_parts.module, self.actor_sp)
            self.actor = DataParallelPPOActor(
                cfg.actor,
                self.actor_module,
                self.actor_parts.optimizer,
                response_length=int(cfg.rollout.response_length),
            )
            processing = load_processor(resolve_local_path(cfg.model.path), self.tokenizer) or self.tokenizer
            self.checkpoint_manager = _checkpoint_manager(  # a VLM's processor files too (verl: processor)
                self.actor_parts, processing, cfg.actor.checkpoint.save_contents, lora_enabled(cfg.model)
            )
        elif self._is_rollout:
            self.actor_module = build_fsdp_module(
                cfg.model, cfg.actor.fsdp_config, self.mesh(self.actor_tp), trainable=False
            )
            self._sequence_parallel(self.actor_module, self.actor_sp)
        if self._is_rollout:
            self.rollout = self._build_rollout()
            self._rollout_weights_stale = False  # the rollout starts from the actor's current weights
            self.weight_version = 0  # actor updates the engine has received
        if self._is_ref:
            self.ref_policy = DataParallelPPOActor(cfg.ref, self._ref_module())

    def _build_rollout(self):
        """The rollout over the actor's module; the engine gets its generation group (HybridFlow §5)."""
        cls = get_rollout_cls(self.config.rollout.name)
        kwargs = {"rank": self.rank, "tokenizer": self.tokenizer}
        if getattr(cls, "reads_model_directory", False):  # vLLM builds its model from the HF directory
            kwargs["model_path"] = resolve_local_path(self.config.model.path)
            kwargs["trust_remote_code"] = bool(self.config.model.get("trust_remote_code", False))
        if not self.layout.trivial:
            if self.config.rollout.name != "engine":
                raise ValueError(
                    f"rollout.name={self.config.rollout.name}: tensor parallelism (actor or rollout "
                    "tensor_model_parallel_size > 1) needs the embedded engine (rollout.name=engine)"
                )
            kwargs.update(layout=self.layout, shard=generation_shard(self.layout, self.rank))
        return cls(self.actor_module, self.config.rollout, **kwargs)

    def _ref_module(self):
        """The reference policy's weights: a LoRA actor's own module (run with the adapter off),
        else a frozen copy of the base model."""
        if self._is_actor and lora_enabled(self.config.model):
            return self.actor_module  # its SP is the actor's (the config check makes ref's equal)
        module = build_fsdp_module(
            self.config.model, self.config.ref.fsdp_config, self.mesh(self.ref_tp), trainable=False
        )
        return self._sequence_parallel(module, self.ref_sp)

    # ------------------------------------------------------------------ rollout
    @register(dispatch_mode=ROLLOUT_DISPATCH)
    @annotate("gen", role="rollout")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Prompts (B, T_p) → prompts + responses; see ``hybridflow.workers.rollout.base``."""
        prompts.meta_info.setdefault("eos_token_id", self.eos_token_ids)
        prompts.meta_info.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        metrics = self._sync_rollout_weights()
        start = time.perf_counter()
        output = self.rollout.generate_sequences(prompts)
        if self.config.rollout.get("free_cache_engine", True):
            # verl's sleep: no generation copy of the weights stays beside the training state
            self.rollout.release_weights()
        # the sampling temperature stays with the rollout: log-probs take it from config only
        output.meta_info.pop("temperature", None)
        metrics.update(output.meta_info.pop("metrics", {}))
        metrics["generate_sequences"] = time.perf_counter() - start
        output.meta_info["metrics"] = metrics
        return output

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights_by_checkpoint_engine(self) -> tuple:
        """The actor's full weights under their HF names (a LoRA adapter merged in), one FSDP unit at a
        time, through this rank's checkpoint engine (:mod:`hybridflow.workers.checkpoint_engine`) to the
        standalone rollout replicas. A collective: every rank gathers the same units in the same order.
        Returns ``(the engine's result, stats)``: time, bytes sent, resident set before and peak."""
        from hybridflow.workers.checkpoint_engine import measured_sync, trainer_weight_stream

        engine = self.checkpoint_engine
        payload, stats = measured_sync(lambda: engine.send_weights(trainer_weight_stream(self.actor_module)))
        return payload, {**engine.stats, **stats}

    # ------------------------------------------------------------------ server mode (rollout.mode=async)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_wake_up(self, rows: int | None = None) -> dict[str, float]:
        """Before a phase of served requests: the actor's current weights into the engine (a collective,
        as before a batch rollout) and its KV cache, for ``rows`` sequences at most (the phase's samples;
        None: full size). Returns the sync's metrics."""
        metrics = self._sync_rollout_weights()
        self.rollout.resume(rows)
        return metrics

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_sleep(self) -> None:
        """After the served phase: with ``free_cache_engine``, nothing generation-only stays beside the
        training state (KV cache, the embedded engine's weight copy)."""
        if self.config.rollout.get("free_cache_engine", True):
            self.rollout.release_weights()
            self.rollout.release()

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    @annotate("gen", role="rollout")
    def serve_requests(self, server) -> dict:
        """Serve ``server``'s requests (this rank's replica) with the rollout's engine until it says stop
        (:func:`hybridflow.workers.rollout.replica.serve_requests`). A long call: the worker takes no
        other call meanwhile, so its collectives keep their order."""
        from hybridflow.workers.rollout.engine_rollout import engine_sampling_params
        from hybridflow.workers.rollout.replica import serve_requests

        if self.rollout_tp > 1:
            raise ValueError(
                "rollout.mode=async serves one engine per rank: rollout.tensor_model_parallel_size=1"
            )
        defaults = engine_sampling_params(self.config.rollout, {}, self.eos_token_ids)
        return serve_requests(self.rollout.engine, server, defaults, weight_version=self.weight_version)

    def _use_training_temperature(self, data: DataProto) -> None:
        """Log-probs, reference log-probs and the update all divide logits by ``rollout.temperature``
        from config: the one source. Whatever a batch carries (a greedy validation rollout samples at
        T = 0) is overwritten, so it can never change the training distribution."""
        data.meta_info["temperature"] = float(self.config.rollout.temperature)

    def _sync_rollout_weights(self) -> dict[str, float]:
        """Hybrid engine: hand the actor's updated weights to the rollout before it generates (also
        after the rollout freed its copy)."""
        if not self._rollout_weights_stale and self.rollout.weights_loaded:
            return {}
        if self._rollout_weights_stale:
            self.weight_version += 1  # the actor's weights changed since the engine last had them
        self._rollout_weights_stale = False
        return self.rollout.update_weights()

    # ------------------------------------------------------------------ log-probs
    @register(dispatch_mode=ACTOR_DISPATCH)
    @annotate("old_log_prob", role="actor")
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropys`` (B, T_r) under the current actor weights."""
        self._use_training_temperature(data)
        log_probs, entropy = self.actor.compute_log_prob(data, self.config.rollout, calculate_entropy=True)
        tensors = {keys.OLD_LOG_PROBS: log_probs, "entropys": entropy}
        if self.actor.recorded_routing is not None:  # router_replay.mode=R2: this pass's routing
            tensors[keys.ROUTED_EXPERTS] = self.actor.recorded_routing
        return DataProto.from_dict(tensors, meta_info={"temperature": data.meta_info["temperature"]})

    @register(dispatch_mode=REF_DISPATCH)
    @annotate("ref", role="ref")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, T_r) under the frozen reference policy (a LoRA actor with its adapter off)."""
        self._use_training_temperature(data)
        with adapter_disabled(self.ref_policy.module):
            log_probs, _ = self.ref_policy.compute_log_prob(data, self.config.ref)
        return DataProto.from_dict({keys.REF_LOG_PROB: log_probs})

    # ------------------------------------------------------------------ training
    @register(dispatch_mode=ACTOR_DISPATCH)
    @annotate("update_actor", role="actor")
    def update_actor(self, data: DataProto) -> DataProto:
        """One PPO update on this rank's shard; returns metrics (means over micro-batches)."""
        self._use_training_temperature(data)
        from hybridflow.utils.device import phase_peak_rss

        start = time.perf_counter()
        lr = self.actor_parts.lr_scheduler.get_last_lr()[0]
        with phase_peak_rss() as update_peak, tally_forwards() as tally:  # peak: one micro-batch's
            metrics = _mean_metrics(self.actor.update_policy(data))
        # the model FLOPs the update's shared prompts did not compute (perf/mfu/actor counts the rest)
        if getattr(self, "_update_flops", None) is None:
            self._update_flops = _update_flops_counter(self.actor_module)
        metrics["perf/shared_prompt_saved_frac"] = self._update_flops.saved_fraction(
            tally.rows, tally.repeated_prompts
        )
        self.actor_parts.lr_scheduler.step()
        self._rollout_weights_stale = self._is_rollout
        metrics.update(
            {"actor/lr": lr, "timing_s/update_actor_worker": time.perf_counter() - start, **_memory_metrics()}
        )
        if "gb" in update_peak:
            metrics["perf/update_actor_max_rss_gb"] = update_peak["gb"]  # "max": the largest rank
        return DataProto(meta_info={"metrics": metrics})


def _update_flops_counter(module):
    """The FLOPs formula of ``module``'s model, as the driver's MFU picks it (its warnings are the
    driver's to give)."""
    import warnings

    from hybridflow.utils.flops_counter import FlopsCounter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FlopsCounter(unwrap_peft(module).config)


def critic_batch_sizes_per_rank(cfg: DictConfig, world: int, rollout_n: int | None = None) -> DictConfig:
    """Config batch sizes are global prompts (verl); the critic works in responses per dp rank
    (``world``: the critic's dp degree). verl's deprecated global micro-batch forms are split over the
    dp ranks. Edits and returns ``cfg``."""
    with open_dict(cfg):
        responses = int(cfg.ppo_mini_batch_size) * int(rollout_n or cfg.get("rollout_n", 1))
        cfg.ppo_mini_batch_size = _per_rank(responses, world, "critic.ppo_mini_batch_size x rollout.n")
        if cfg.get("ppo_micro_batch_size"):
            cfg.ppo_micro_batch_size_per_gpu = _per_rank(
                int(cfg.ppo_micro_batch_size), world, "critic.ppo_micro_batch_size"
            )
        if cfg.get("forward_micro_batch_size"):
            cfg.forward_micro_batch_size_per_gpu = _per_rank(
                int(cfg.forward_micro_batch_size), world, "critic.forward_micro_batch_size"
            )
    return cfg


class CriticWorker(FSDPWorkerBase):
    """The value model: the LM with a one-unit token-classification head."""

    def __init__(self, config, rollout_n: int | None = None) -> None:
        super().__init__()
        config = _own_copy(config)
        self.tp = _tp_size(config)
        self.sp = configured_sp_size(config, config.model.get("fsdp_config"))
        dp = self.register_tp_dispatch("critic", self.tp * self.sp)
        scale_token_budgets(config, self.sp, ("ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu"))
        self.config = critic_batch_sizes_per_rank(config, dp, rollout_n)

    def profiled_roles(self) -> tuple[str, ...]:
        return ("critic",)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int | None = None) -> None:
        """Load the value model. ``total_training_steps``: see :func:`set_total_training_steps`."""
        from hybridflow.models.loading import load_tokenizer

        cfg = self.config
        set_total_training_steps(cfg.optim, total_training_steps)
        self.tokenizer = load_tokenizer(
            resolve_local_path(cfg.model.tokenizer_path),
            trust_remote_code=cfg.model.get("trust_remote_code", False),
        )
        self.critic_parts = build_training_parts(
            cfg.model, cfg.model.fsdp_config, cfg.optim, self.mesh(self.tp), kind="token_value"
        )
        self._sequence_parallel(self.critic_parts.module, self.sp)
        self.critic = DataParallelPPOCritic(cfg, self.critic_parts.module, self.critic_parts.optimizer)
        self.checkpoint_manager = _checkpoint_manager(
            self.critic_parts, self.tokenizer, cfg.checkpoint.save_contents
        )

    @register(dispatch_mode=CRITIC_DISPATCH)
    @annotate("values", role="critic")
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (B, T_r)."""
        return DataProto.from_dict({keys.VALUES: self.critic.compute_values(data)})

    @register(dispatch_mode=CRITIC_DISPATCH)
    @annotate("update_critic", role="critic")
    def update_critic(self, data: DataProto) -> DataProto:
        lr = self.critic_parts.lr_scheduler.get_last_lr()[0]
        metrics = _mean_metrics(self.critic.update_critic(data))
        self.critic_parts.lr_scheduler.step()
        metrics["critic/lr"] = lr
        return DataProto(meta_info={"metrics": metrics})
