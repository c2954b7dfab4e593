"""What a run tells its user at its start and at its end (issue 46 item 3), one ``hybridflow:`` line
each, printed by ``main_ppo`` (docs/first_run.md reads them):

- at start: where its outputs go (the metrics and curves folder, Hydra's own run folder, the
  checkpoints), whether it resumes and from which step (and how to start fresh), the model (its
  family), the rollout backend and the device;
- at the end: the step it stopped at, and where the metrics, curves and checkpoints are.
"""

from __future__ import annotations

import json
import os
import re

from omegaconf import DictConfig

STEP_DIR = re.compile(r"global_step_(\d+)$")


def output_folder(config: DictConfig) -> str:
    """Where the trackers write ``metrics.jsonl`` and the PNG curves (as ``main_ppo.log_dir``)."""
    return os.path.join("outputs", str(config.trainer.project_name), str(config.trainer.experiment_name))


def _hydra_run_dir() -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):  # not under @hydra.main (a test, a library call)
        return None


def _model_family(path: str) -> str:
    try:
        with open(os.path.join(os.path.expanduser(path), "config.json")) as config_file:
            return str(json.load(config_file).get("model_type", "unknown"))
    except (OSError, ValueError):
        return "unknown"


def resume_line(config: DictConfig, latest: str | None) -> str:
    """Whether this run starts fresh or resumes, from what, and how to choose otherwise. ``latest``: the
    newest complete checkpoint ``resume_mode=auto`` would load (None: none)."""
    trainer = config.trainer
    mode = str(trainer.get("resume_mode", "auto"))
    if mode == "disable":
        return "starting fresh (trainer.resume_mode=disable: checkpoints in the folder are not read)"
    if mode == "resume_path":
        return f"resuming from {trainer.resume_from_path} (trainer.resume_mode=resume_path)"
    if latest is None:
        return (
            f"starting fresh: no checkpoint in {trainer.default_local_dir} (trainer.resume_mode=auto "
            "resumes from there when this command runs again)"
        )
    match = STEP_DIR.search(os.path.normpath(latest))
    step = match.group(1) if match else "?"
    return (
        f"resuming from step {step} ({latest}), as trainer.resume_mode=auto does when the same command runs "
        "again; to start fresh set trainer.resume_mode=disable or another trainer.experiment_name"
    )


def start_lines(config: DictConfig, latest: str | None) -> list[str]:
    """The lines printed before the workers start (``latest``: as :func:`resume_line`)."""
    rollout, trainer = config.actor_rollout_ref.rollout, config.trainer
    path = str(config.actor_rollout_ref.model.path)
    workers = int(trainer.n_gpus_per_node) * int(trainer.nnodes)
    folders = f"outputs: metrics and curves in {output_folder(config)}"
    hydra_dir = _hydra_run_dir()
    if hydra_dir:
        folders += f", Hydra's run folder {hydra_dir}"
    saving = int(trainer.get("save_freq", -1)) > 0
    folders += f", checkpoints in {trainer.default_local_dir}" + (
        "" if saving else " (save_freq=-1: none saved)"
    )
    return [
        folders,
        resume_line(config, latest),
        f"model {path} ({_model_family(path)}); rollout {rollout.name} ({rollout.get('mode', 'sync')}) on "
        f"{trainer.get('device', 'cpu')}, {workers} worker(s)",
    ]


def end_lines(config: DictConfig, step: int, latest: str | None) -> list[str]:
    """The lines printed when the run ends at ``step`` (``latest``: its newest checkpoint, or None)."""
    folder = output_folder(config)
    lines = [f"stopped after step {step}: metrics {os.path.join(folder, 'metrics.jsonl')}"]
    if "jsonl" in list(config.trainer.logger) and config.trainer.get("plot_curves", True):
        lines[0] += f", curves {os.path.join(folder, 'curves.png')}"
    lines.append(f"checkpoints: {latest}" if latest else "checkpoints: none saved (trainer.save_freq)")
    return lines
