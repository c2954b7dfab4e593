"""The distillation keys checked before Ray starts: ``actor_rollout_ref.teacher``,
``actor_rollout_ref.actor.distill_loss`` and ``trainer.scheduler`` (docs/distillation.md)."""

from __future__ import annotations

from omegaconf import DictConfig

SCHEDULER_NAMES = ("sequential", "one_step_off", "two_step_off")
MAX_TEACHER_TOP_K = 1024  # hybridflow.serve.scoring.MAX_TOP_K


def distillation_enabled(config: DictConfig) -> bool:
    teacher = config.actor_rollout_ref.get("teacher") or {}
    return teacher.get("server_ip") is not None


def distill_problems(config: DictConfig) -> list[str]:
    """One line per distillation setting that would not do what it says."""
    from hybridflow.algorithms.distillation import DistillConfig, distill_config_problems

    scheduler = str(config.trainer.get("scheduler", "sequential"))
    problems = []
    if scheduler not in SCHEDULER_NAMES:
        problems.append(f"trainer.scheduler={scheduler!r} is not one of {list(SCHEDULER_NAMES)}")
    section = config.actor_rollout_ref.actor.get("distill_loss") or {}
    if not distillation_enabled(config):
        if scheduler != "sequential":
            problems.append(
                f"trainer.scheduler={scheduler} overlaps the teacher's scoring with generation and the "
                "update, and no teacher is set: set actor_rollout_ref.teacher.server_ip (or "
                "scheduler=sequential)"
            )
        if DistillConfig.from_config(section) != DistillConfig():
            problems.append(
                "actor_rollout_ref.actor.distill_loss is set and no teacher is: it would do nothing; set "
                "actor_rollout_ref.teacher.server_ip"
            )
        return problems
    return problems + distill_config_problems(section) + _teacher_problems(config, scheduler)


def _teacher_problems(config: DictConfig, scheduler: str) -> list[str]:
    teacher = config.actor_rollout_ref.teacher
    problems = []
    bounds = {
        "server_port": (1, 65535),
        "n_server_workers": (1, 1024),
        "n_logprobs": (1, MAX_TEACHER_TOP_K),
        "micro_batch_size": (1, 1 << 20),
        "max_retries": (0, 100),
    }
    for key, (low, high) in bounds.items():
        value = teacher.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            problems.append(f"actor_rollout_ref.teacher.{key}={value} must be an integer in [{low}, {high}]")
    if int(teacher.get("server_port") or 0) + int(teacher.get("n_server_workers") or 1) - 1 > 65535:
        problems.append("actor_rollout_ref.teacher: server_port + n_server_workers - 1 is past port 65535")
    for key in ("temperature", "timeout_s"):
        if not float(teacher.get(key) or 0) > 0:
            problems.append(f"actor_rollout_ref.teacher.{key}={teacher.get(key)} must be > 0")
    from hybridflow.trainer.config.parallelism import sp_size, tp_size

    if tp_size(config, "actor_rollout_ref.actor") > 1 or sp_size(config, "actor_rollout_ref.actor") > 1:
        problems.append(
            "on-policy distillation reads the student's whole-vocabulary logits of whole sequences: "
            "actor.tensor_model_parallel_size and ulysses_sequence_parallel_size (also under "
            "actor.fsdp_config) must be 1"
        )
    if config.algorithm.filter_groups.get("enable"):
        problems.append(
            "algorithm.filter_groups.enable=true (dynamic sampling) with a teacher: the scheduler scores one "
            "generated batch per step; turn one of them off"
        )
    if scheduler != "sequential" and int(config.trainer.get("save_freq", -1)) > 0:
        problems.append(
            f"trainer.scheduler={scheduler} generates batches ahead of the update, and a resumed run would "
            "not train the batches in flight at the save: use scheduler=sequential with save_freq > 0"
        )
    if "async_training" in config:
        problems.append(
            "actor_rollout_ref.teacher is read by main_ppo (trainer/distill), not by fully_async_main: run "
            "python -m hybridflow.trainer.main_ppo"
        )
    return problems
