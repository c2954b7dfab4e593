"""Building and running the fully-asynchronous trainer (``python -m hybridflow.trainer.fully_async_main``).

Two pools: the trainer's (``trainer.nnodes x trainer.n_gpus_per_node`` processes: actor, reference,
critic — no rollout engine) and the rollouter's (``rollout.nnodes x rollout.n_gpus_per_node``
standalone replicas, each with its own engine). The config is ``ppo_trainer.yaml`` plus verl's
fully-async sections (``fully_async_ppo_trainer.yaml``), all checked before Ray starts.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf, open_dict

from hybridflow.protocol import DataProto

ASYNC_SECTIONS = ("rollout", "async_training")


def fully_async_problems(config: DictConfig) -> list[str]:
    """What is wrong with the fully-async sections (the PPO part is checked by ``validate_config``)."""
    from hybridflow.trainer.config.async_honesty import fully_async_honesty_problems
    from hybridflow.trainer.config.mistakes import entry_schema, unknown_key_problems

    schema = entry_schema("fully_async_ppo_trainer")
    problems = unknown_key_problems(config, schema, "fully_async_ppo_trainer.yaml", sections=ASYNC_SECTIONS)
    asynchronous = config.async_training
    if float(asynchronous.staleness_threshold) < 0:
        problems.append(
            f"async_training.staleness_threshold must be >= 0, got {asynchronous.staleness_threshold}"
        )
    for key in ("trigger_parameter_sync_step", "require_batches"):
        if int(asynchronous[key]) < 1:
            problems.append(f"async_training.{key} must be >= 1, got {asynchronous[key]}")
    restarts = config.actor_rollout_ref.rollout.get("max_replica_restarts", 3)
    if not isinstance(restarts, int) or restarts < 0:
        problems.append(
            f"actor_rollout_ref.rollout.max_replica_restarts must be an integer >= 0, got {restarts}"
        )
    if int(config.data.gen_batch_size) < 1:
        problems.append(f"data.gen_batch_size must be >= 1, got {config.data.gen_batch_size}")
    if int(config.rollout.n_gpus_per_node) < 1 or int(config.rollout.nnodes) < 1:
        problems.append("rollout.nnodes and rollout.n_gpus_per_node must be >= 1 (the rollouter's pool)")
    correction = config.algorithm.get("rollout_correction") or {}
    if asynchronous.compute_prox_log_prob and not correction.get("rollout_is"):
        problems.append(
            "async_training.compute_prox_log_prob=true corrects pi_rollout -> pi_prox with importance "
            "weights: set algorithm.rollout_correction.rollout_is=token (or sequence)"
        )
    return problems + fully_async_honesty_problems(config)


def check_config(config: DictConfig) -> DictConfig:
    """Every check made before Ray starts (the fully-async sections, then the PPO view as
    ``main_ppo`` checks it); returns the PPO view. Raises :class:`ConfigError` listing the problems."""
    from hybridflow.trainer.config import ConfigError, apply_rollout_correction_mode, validate_config

    OmegaConf.resolve(config)
    problems = fully_async_problems(config)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
    view = ppo_view(config)
    validate_config(view)
    apply_rollout_correction_mode(view)
    return view


def groups_per_step(config: DictConfig) -> int:
    """Prompt groups a trainer step takes: ``require_batches x ppo_mini_batch_size``."""
    return int(config.async_training.require_batches) * int(
        config.actor_rollout_ref.actor.ppo_mini_batch_size
    )


def admission_bound(config: DictConfig) -> int:
    """verl's ``max_required_samples``: groups admitted per parameter version."""
    asynchronous = config.async_training
    return int(
        groups_per_step(config)
        * (1 + float(asynchronous.staleness_threshold))
        * int(asynchronous.trigger_parameter_sync_step)
    )


def ppo_view(config: DictConfig) -> DictConfig:
    """The PPO part of a fully-async config, as ``validate_config`` and the workers read it: the trainer
    step's batch is ``groups_per_step`` prompts; the rollout runs agent loops (server mode); the actor
    workers hold no engine (``hybrid_engine`` is the rollouter's business)."""
    from hybridflow.trainer.config import load_schema

    view = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    for section in ASYNC_SECTIONS:
        view.pop(section)
    with open_dict(view):
        view.data.pop("gen_batch_size")
        view.data.train_batch_size = groups_per_step(config)
        view.actor_rollout_ref.rollout.mode = "async"
        view.actor_rollout_ref.hybrid_engine = True
        # the weight transfer between the pools is the trainer's (_with_async puts its section back):
        # the view keeps main_ppo's colocated defaults, which its checks expect
        defaults = load_schema().actor_rollout_ref.rollout.checkpoint_engine
        view.actor_rollout_ref.rollout.checkpoint_engine = defaults
        # the replicas' restarts are the rollouter's (build reads them from the config): main_ppo's default
        view.actor_rollout_ref.rollout.max_replica_restarts = (
            load_schema().actor_rollout_ref.rollout.max_replica_restarts
        )
        rollout_steps = config.rollout.get("total_rollout_steps")
        if rollout_steps and not config.trainer.get("total_training_steps"):
            view.trainer.total_training_steps = max(1, int(rollout_steps) // groups_per_step(config))
        if int(config.rollout.get("test_freq", -1)) > 0:  # validate every N syncs, counted in steps
            view.trainer.test_freq = int(config.rollout.test_freq) * int(
                config.async_training.trigger_parameter_sync_step
            )
    return view


def prompt_stream(loader, start: int):
    """``(one-prompt DataProto, epoch)`` in data order from the ``start``-th prompt on, across epochs."""
    per_epoch = len(loader) * loader.batch_size
    epoch, within = divmod(int(start), per_epoch)
    loader.load_state_dict(
        {"epoch": epoch, "batches_yielded": within // loader.batch_size, "seed": loader.seed}
    )
    skip = within % loader.batch_size
    while True:
        epoch = loader.epoch if loader.batches_yielded < len(loader) else loader.epoch + 1
        for batch_dict in loader:
            batch = DataProto.from_single_dict(batch_dict, meta_info={"epoch": epoch})
            for row in range(len(batch)):
                if skip:
                    skip -= 1
                    continue
                yield batch.select_idxs([row]), epoch


def build_rollout_group(config: DictConfig, view: DictConfig):
    """The rollouter's pool (``config.rollout``): standalone replicas of ``view.actor_rollout_ref``,
    started in the background."""
    from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from hybridflow.workers.rollout_worker import StandaloneRolloutWorker

    pool = RayResourcePool(
        process_on_nodes=[int(config.rollout.n_gpus_per_node)] * int(config.rollout.nnodes),
        use_gpu=view.trainer.device == "cuda",
        max_colocate_count=1,
        cpus_per_process=1.0,
        name_prefix="rollout_pool",
    )
    return RayWorkerGroup(
        pool,
        RayClassWithInitArgs(StandaloneRolloutWorker, view.actor_rollout_ref),
        name_prefix="hybridflow_rollout",
        num_threads=int(view.trainer.num_threads_per_worker),
        env={"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")},
    )


def build(config: DictConfig, view: DictConfig, groups, rollout_group):
    """The trainer with its rollouter, over the two pools (whose processes are starting)."""
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.trainer.fully_async.message_queue import GroupQueue
    from hybridflow.trainer.fully_async.rollouter import Rollouter
    from hybridflow.trainer.fully_async.trainer import FullyAsyncTrainer
    from hybridflow.trainer.main_ppo import build_dataloaders, log_dir
    from hybridflow.utils.tracking import Tracking
    from hybridflow.workers.reward_manager import build_reward_manager
    from hybridflow.workers.rollout.agent_loop.manager import AgentLoopManager

    model = view.actor_rollout_ref.model
    tokenizer = load_tokenizer(
        os.path.expanduser(view.data.tokenizer or model.path),
        trust_remote_code=bool(view.data.get("trust_remote_code", False)),
        custom_chat_template=model.custom_chat_template,
    )
    loader_view = OmegaConf.merge(view, {"data": {"train_batch_size": int(config.data.gen_batch_size)}})
    train_loader, val_loader = build_dataloaders(loader_view, tokenizer)
    max_length = int(view.data.max_response_length)
    if view.reward_model.get("use_reward_loop", False):  # scored in the stream, in each sample's agent loop
        from hybridflow.workers.reward_loop import RewardLoop

        reward = [RewardLoop(view, tokenizer), RewardLoop(view, tokenizer)]
    else:
        reward = [
            build_reward_manager(
                view.reward_model,
                view.custom_reward_function,
                tokenizer,
                k,
                max_length,
                reward_fn_key=str(view.data.get("reward_fn_key", "data_source")),
                manager_section=view.get("reward_manager"),
            )
            for k in (0, 1)  # training (no examples printed), validation (one)
        ]
    rollout_group.init_model()  # waits for the rollout processes
    restarts = int(config.actor_rollout_ref.rollout.get("max_replica_restarts", 3))
    manager = AgentLoopManager(view, rollout_group, max_replica_restarts=restarts)  # elastic replicas
    queue = GroupQueue(capacity=admission_bound(config))
    trainer_box = {}
    rollouter = Rollouter(
        manager,
        _lazy_prompts(train_loader, lambda: trainer_box["trainer"].queue.taken),
        queue,
        int(view.actor_rollout_ref.rollout.n),
        admission_bound(config),
        bool(config.async_training.partial_rollout),
    )
    tracker = Tracking(
        project_name=view.trainer.project_name,
        experiment_name=view.trainer.experiment_name,
        default_backend=list(view.trainer.logger),
        config=OmegaConf.to_container(config, resolve=True),
        log_dir=log_dir(view),
    )
    steps_per_epoch = max(1, len(train_loader) * int(config.data.gen_batch_size) // groups_per_step(config))
    trainer = FullyAsyncTrainer(
        _with_async(view, config),
        tokenizer,
        val_loader,
        reward[0],
        reward[1],
        queue=queue,
        rollouter=rollouter,
        rollout_group=rollout_group,
        manager=manager,
        steps_per_epoch=steps_per_epoch,
        tracker=tracker,
        worker_groups=groups,
    )
    trainer_box["trainer"] = trainer
    return trainer


def _lazy_prompts(loader, start):
    """The prompt stream, positioned when first read (after a checkpoint may have moved the start)."""
    stream = None
    while True:
        if stream is None:
            stream = prompt_stream(loader, start())
        yield next(stream)


def _with_async(view: DictConfig, config: DictConfig) -> DictConfig:
    """The PPO view with the fully-async sections back (the trainer reads async_training, and the
    checkpoint engine's section for its weight sync)."""
    merged = OmegaConf.create(OmegaConf.to_container(view, resolve=True))
    with open_dict(merged):
        for section in ASYNC_SECTIONS:
            merged[section] = OmegaConf.to_container(config[section], resolve=True)
        engine = config.actor_rollout_ref.rollout.checkpoint_engine
        merged.actor_rollout_ref.rollout.checkpoint_engine = OmegaConf.to_container(engine, resolve=True)
    return merged


def run_fully_async(config: DictConfig) -> dict[str, float]:
    """Validate, start Ray (if needed) and both pools, train; returns the last step's metrics. The
    run's processes and the Ray instance started here are shut down before it returns or raises."""
    import torch

    from hybridflow.trainer.main_ppo import _plot, _shut_down
    from hybridflow.trainer.ppo.checkpointing import TrainerCheckpointer
    from hybridflow.trainer.ppo.preemption import StopRequest
    from hybridflow.trainer.ppo.workers_setup import build_worker_groups, ensure_ray
    from hybridflow.utils.roles import need_critic, need_reference

    view = check_config(config)
    torch.set_num_threads(1)
    TrainerCheckpointer(view.trainer).preflight(view)
    started_ray = ensure_ray(view.ray_init)
    groups = rollout_group = trainer = None
    stop = StopRequest()
    with stop:
        try:
            groups = build_worker_groups(view, need_critic(view), need_reference(view), hybrid=False)
            rollout_group = build_rollout_group(config, view)
            trainer = build(config, view, groups, rollout_group)
            trainer.stop = stop
            trainer.init_workers()
            return trainer.fit()
        finally:
            stop.shield()
            try:
                if trainer is not None:
                    trainer.tracker.finish()
                    _plot(view, trainer.tracker)
                    trainer.rollout_manager.shutdown()
                if rollout_group is not None:
                    rollout_group.shutdown()
            finally:
                _shut_down(groups, owns_ray=started_ray)
