"""Entry point: ``python -m hybridflow.trainer.main_ppo key=value ...`` (verl's command-line shape).

Also ``--config-path DIR --config-name NAME`` with a user YAML whose defaults list ``ppo_trainer``.
The config is validated completely, and the checkpoint directory probed, before Ray starts.

Exit codes: 0 done; 2 a config mistake, reported in one line before anything starts (an unknown key
with the nearest valid one, a size that is not positive, a missing file: ``hydra_entry.py``;
``HYDRA_FULL_ERROR=1`` keeps the traceback); 1 an error reported in one line (checkpoint directory
unusable, a save that failed, no complete checkpoint to resume from, a reward function that raised or
timed out; other errors keep their traceback); 124 a reward function stuck in native code
(``workers/reward_manager/timeouts.py``); 128 + signal after a SIGTERM/SIGINT stop (143 / 130;
``trainer/ppo/preemption.py``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from hybridflow.trainer.hydra_entry import hydra_entry  # noqa: E402
from hybridflow.trainer.ppo.preemption import StopRequest, TrainingPreempted  # noqa: E402


@hydra_entry("ppo_trainer")
def main(config: DictConfig) -> None:
    try:
        run_ppo(config)
    except TrainingPreempted as stop:
        print(f"hybridflow: {stop} (exit code {stop.exit_code})", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except one_line_errors() as err:  # the message says it all: no traceback to dig through
        print(f"hybridflow: error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)


def one_line_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message names what failed, where, and what to do."""
    from hybridflow.trainer.ppo.workers_setup import NodeLostError
    from hybridflow.utils.checkpoint.manifest import CheckpointDamagedError
    from hybridflow.utils.checkpoint.preflight import CheckpointDirError, CheckpointSaveError
    from hybridflow.utils.rollout_parity import RolloutLogProbGapError
    from hybridflow.workers.reward_manager import RewardScoreError

    return (
        CheckpointDirError,
        CheckpointSaveError,
        CheckpointDamagedError,
        RewardScoreError,
        NodeLostError,
        RolloutLogProbGapError,
    )


def run_ppo(config: DictConfig, worker_groups=None) -> dict[str, float]:
    """Validate, check the checkpoint directory, start Ray if needed, build data/reward/workers, train.
    Returns the last metrics; raises ``TrainingPreempted`` after a SIGTERM/SIGINT stop. Workers built
    here, and a Ray instance started here, are shut down before it returns or raises."""
    import torch

    from hybridflow.placement.planner import resolve_auto_placement
    from hybridflow.single_controller.ray import WorkerDiedError
    from hybridflow.trainer.config import apply_rollout_correction_mode, validate_config
    from hybridflow.trainer.config.honesty import startup_notes
    from hybridflow.trainer.ppo import run_summary
    from hybridflow.trainer.ppo.checkpointing import TrainerCheckpointer
    from hybridflow.trainer.ppo.workers_setup import ensure_ray
    from hybridflow.utils.checkpoint.preflight import CheckpointSaveError

    OmegaConf.resolve(config)
    validate_config(config)
    apply_rollout_correction_mode(config)  # before any worker receives its config
    for note in startup_notes(config) + resolve_auto_placement(config):  # (and the planner's choice)
        print(f"hybridflow: {note}", flush=True)
    torch.set_num_threads(1)  # the driver only moves batches and does light maths
    checkpointer = TrainerCheckpointer(config.trainer)
    checkpointer.preflight(config)  # a bad checkpoint dir fails in seconds
    for line in run_summary.start_lines(config, checkpointer.latest()):  # folders, resume, model, backend
        print(f"hybridflow: {line}", flush=True)
    started_ray = ensure_ray(config.ray_init)
    stop, trainer, groups, judge = StopRequest(), None, worker_groups, None
    with stop:  # from here SIGTERM/SIGINT finish the step, save, stop (trainer/ppo/preemption.py)
        try:
            if groups is None:  # the worker processes start now; data, tokenizer and reward load meanwhile
                groups = start_worker_groups(config)
            judge = start_reward_model(config)  # a served RM in the reward loop (None: none)
            trainer = build_trainer(config, groups, judge=judge)
            trainer.stop = stop
            trainer.init_workers()
            print(f"hybridflow: ready to train {seconds_since_process_start():.1f} s after start", flush=True)
            return trainer.fit()
        except TrainingPreempted as err:
            if err.abandoned:  # raised by the second signal's handler: say where the run stands
                step = trainer.global_steps if trainer is not None else 0
                latest = TrainerCheckpointer(config.trainer).latest()
                raise TrainingPreempted(err.signum, step, latest, True) from None
            raise
        except (WorkerDiedError, CheckpointSaveError) as err:  # a lost node: name it and its roles
            from hybridflow.trainer.ppo.workers_setup import node_lost_error

            lost = node_lost_error(err, groups, TrainerCheckpointer(config.trainer).latest())
            if lost is None:
                raise
            raise lost from err
        finally:
            stop.shield()  # the clean-up below is short: later signals do not cut it
            try:
                if trainer is not None:
                    trainer.tracker.finish()
                    _plot(config, trainer.tracker)
                    for line in run_summary.end_lines(config, trainer.global_steps, checkpointer.latest()):
                        print(f"hybridflow: {line}", flush=True)
                write_ray_timeline(config.ray_init.get("timeline_json_file"))
            finally:
                if judge is not None:
                    judge.shutdown()
                _shut_down(groups if worker_groups is None else None, owns_ray=started_ray)


def seconds_since_process_start() -> float:
    """Wall seconds since this process started (interpreter start-up and imports included)."""
    import time

    import psutil

    return time.time() - psutil.Process().create_time()


def start_worker_groups(config: DictConfig):
    """The run's worker groups, created without waiting for their processes to come up."""
    from hybridflow.trainer.ppo.workers_setup import build_worker_groups
    from hybridflow.utils.roles import need_critic, need_reference

    return build_worker_groups(config, need_critic(config), need_reference(config))


def start_reward_model(config: DictConfig):
    """``reward_model.enable`` with ``use_reward_loop``: the reward model served
    (:class:`~hybridflow.workers.reward_loop.servers.RewardModelServers`: replicas + router, healthy
    before it returns), its router written into ``reward_model.reward_kwargs.reward_router_address`` for
    the reward loops (the trainer's, the agent loops'); a watcher reports a replica that exits. None
    without a served reward model."""
    from omegaconf import open_dict

    from hybridflow.utils.roles import served_reward_model
    from hybridflow.workers.reward_loop.servers import RewardModelServers

    if not served_reward_model(config):
        return None
    judge = RewardModelServers.from_config(config, log_dir=os.path.join(log_dir(config), "reward_model"))
    mode = "standalone" if config.reward_model.get("enable_resource_pool") else "colocated"
    print(f"hybridflow: serving the reward model ({mode}): {judge.describe()}", flush=True)
    judge.start()
    with open_dict(config):
        config.reward_model.reward_kwargs["reward_router_address"] = judge.address
    judge.watch()
    if mode == "colocated" and config.reward_model.rollout.get("free_cache_engine", True):
        judge.sleep()  # as verl's: asleep until the first reward phase wakes it
    print(f"hybridflow: reward model at http://{judge.address} (logs: {judge.log_dir})", flush=True)
    return judge


def _shut_down(own_groups, owns_ray: bool) -> None:
    """Stop the workers built here and the Ray instance started here; never masks the run's error."""
    from hybridflow.trainer.ppo.workers_setup import shutdown_ray

    steps = []
    if own_groups is not None:
        steps.append(("the worker groups", own_groups.shutdown))
    if owns_ray:
        steps.append(("Ray", shutdown_ray))
    for what, step in steps:
        try:
            step()
        except Exception as err:  # best effort: the process is ending anyway
            print(f"hybridflow: shutting down {what} failed: {type(err).__name__}: {err}", file=sys.stderr)


def write_ray_timeline(path: str | None) -> None:
    """``ray_init.timeline_json_file``: Ray's task timeline (chrome://tracing JSON), as verl writes it."""
    if not path:
        return
    import ray

    path = os.path.expanduser(str(path))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ray.timeline(filename=path)
    print(f"ray timeline: {path}")


def build_trainer(config: DictConfig, worker_groups=None, judge=None):
    """The trainer; ``judge``: the served reward model (:func:`start_reward_model`), woken and put to
    sleep around each reward phase when colocated."""
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.trainer.ppo.ray_trainer import RayPPOTrainer
    from hybridflow.utils.dataset.multimodal import load_processor
    from hybridflow.utils.tracking import Tracking
    from hybridflow.workers.reward_manager import build_reward_manager

    tokenizer = load_tokenizer(
        os.path.expanduser(config.data.tokenizer or config.actor_rollout_ref.model.path),
        trust_remote_code=bool(config.data.get("trust_remote_code", False)),
        custom_chat_template=config.actor_rollout_ref.model.custom_chat_template,
    )
    processor = load_processor(config.actor_rollout_ref.model.path, tokenizer)  # None: a text-only model
    train_loader, val_loader = build_dataloaders(config, tokenizer, processor)
    max_resp_len = int(config.data.max_response_length)
    if config.reward_model.get("use_reward_loop", False):  # verl's reward loop: each sample on its own
        from hybridflow.workers.reward_loop import RewardLoop

        colocated = None if config.reward_model.get("enable_resource_pool") else judge
        reward_fn = RewardLoop(config, tokenizer, judge=colocated)
        val_reward_fn = RewardLoop(config, tokenizer, judge=colocated)
    else:
        reward_fn = build_reward_manager(
            config.reward_model,
            config.custom_reward_function,
            tokenizer,
            num_examine=0,
            max_resp_len=max_resp_len,
            reward_fn_key=str(config.data.reward_fn_key),
            manager_section=config.get("reward_manager"),
        )
        val_reward_fn = build_reward_manager(
            config.reward_model,
            config.custom_reward_function,
            tokenizer,
            num_examine=1,
            max_resp_len=max_resp_len,
            reward_fn_key=str(config.data.reward_fn_key),
            manager_section=config.get("reward_manager"),
        )
    tracker = Tracking(
        project_name=config.trainer.project_name,
        experiment_name=config.trainer.experiment_name,
        default_backend=list(config.trainer.logger),
        config=OmegaConf.to_container(config, resolve=True),
        log_dir=log_dir(config),
    )
    trainer_cls, extra = RayPPOTrainer, {}
    if config.actor_rollout_ref.get("teacher", {}).get("server_ip") is not None:  # on-policy distillation
        from hybridflow.trainer.distill import OnPolicyDistillTrainer, connect_teacher

        trainer_cls, extra = OnPolicyDistillTrainer, {"teacher": connect_teacher(config, tokenizer)}
    return trainer_cls(
        config,
        tokenizer,
        train_loader,
        val_loader,
        reward_fn,
        val_reward_fn,
        tracker=tracker,
        worker_groups=worker_groups,
        **extra,
    )


def log_dir(config: DictConfig) -> str:
    return os.path.join("outputs", config.trainer.project_name, config.trainer.experiment_name)


def build_dataloaders(config: DictConfig, tokenizer, processor=None):
    """Train and validation loaders; ``processor``: a vision-language model's (image rows)."""
    from hybridflow.utils.dataset import RLHFDataset, StatefulDataLoader, collate_fn
    from hybridflow.utils.dataset.multimodal import check_image_limit

    data = config.data
    if config.actor_rollout_ref.rollout.get("mode") == "async":  # agent loops read the messages
        data = OmegaConf.merge(data, {"return_raw_chat": True})
    dataset_cls = dataset_class(data.get("custom_cls")) or RLHFDataset
    extra = {"processor": processor} if processor is not None else {}
    train = dataset_cls(
        data_files=list(_as_list(data.train_files)), tokenizer=tokenizer, config=data, **extra
    )
    val = dataset_cls(data_files=list(_as_list(data.val_files)), tokenizer=tokenizer, config=data, **extra)
    for dataset in (train, val):
        check_image_limit(dataset, config.actor_rollout_ref.rollout.get("limit_images"))
    train_loader = StatefulDataLoader(
        train,
        batch_size=int(data.train_batch_size),
        shuffle=bool(data.shuffle),
        seed=int(data.seed),
        drop_last=True,
        collate_fn=collate_fn,
    )
    val_loader = StatefulDataLoader(
        val,
        batch_size=int(data.val_batch_size or len(val)),
        shuffle=bool(data.validation_shuffle),
        seed=int(data.seed),
        drop_last=False,
        collate_fn=collate_fn,
    )
    if len(train_loader) == 0:
        raise ValueError(
            f"data.train_files hold {len(train)} prompts, fewer than data.train_batch_size="
            f"{data.train_batch_size}"
        )
    return train_loader, val_loader


def dataset_class(custom_cls):
    """verl's ``data.custom_cls``: class ``name`` from the Python file ``path`` (a torch ``Dataset`` built
    as ``cls(data_files=..., tokenizer=..., config=data)`` whose items RLHFDataset's collate accepts);
    None when no path is set."""
    if not custom_cls or not custom_cls.get("path"):
        return None
    import importlib.util

    from torch.utils.data import Dataset

    path = os.path.expanduser(str(custom_cls.path))
    spec = importlib.util.spec_from_file_location("hybridflow_custom_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, str(custom_cls.name), None)
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        raise TypeError(f"data.custom_cls: {custom_cls.name!r} in {path} is not a torch Dataset class")
    return cls


def _as_list(value):
    return [value] if isinstance(value, str) else list(value)


def _plot(config: DictConfig, tracker) -> None:
    if not config.trainer.get("plot_curves", True) or "jsonl" not in list(config.trainer.logger):
        return
    from hybridflow.utils.plot_metrics import plot_metrics

    metrics_path = os.path.join(log_dir(config), "metrics.jsonl")
    if os.path.exists(metrics_path) and os.path.getsize(metrics_path) > 0:
        out = os.path.join(log_dir(config), "curves.png")
        try:
            plot_metrics(metrics_path, out)
            print(f"curves: {out}")
        except ValueError as err:  # nothing plottable logged (e.g. a run that stopped early)
            print(f"no curves written: {err}")


if __name__ == "__main__":
    main()
