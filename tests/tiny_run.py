"""The config of a tiny end-to-end run that many tests start: the tiny model on the arithmetic task,
4 prompts x 2 responses, 6-token answers, jsonl metrics, no progress bar. Tests add what they check."""

from __future__ import annotations

from pathlib import Path


def tiny_run_values(model_dir, data: tuple[str, str], ckpt_dir: Path | str | None = None, **extra) -> dict:
    """``key: value`` overrides of a tiny run (``extra`` wins; a ``ckpt_dir`` sets
    ``trainer.default_local_dir``)."""
    train, test = data
    values = {
        "data.train_files": train,
        "data.val_files": test,
        "actor_rollout_ref.model.path": model_dir,
        "data.train_batch_size": 4,
        "data.max_prompt_length": 40,
        "data.max_response_length": 6,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "trainer.logger": "[jsonl]",
        "trainer.progress_bar": False,
        "trainer.plot_curves": False,
        "trainer.val_before_train": False,
    }
    if ckpt_dir is not None:
        values["trainer.default_local_dir"] = str(ckpt_dir)
    values.update(extra)
    return values


def as_overrides(values: dict) -> list[str]:
    """Hydra command-line form: ``["key=value", ...]``."""
    return [f"{key}={value}" for key, value in values.items()]


# A short PPO run with a KL loss and a critic: the shape several e2e tests compare runs of.
PPO_EXTRA = {
    "actor_rollout_ref.actor.optim.lr": 1e-3,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "critic.enable": True,
    "critic.optim.lr": 1e-3,
    "trainer.resume_mode": "disable",
    "trainer.total_training_steps": 2,
}
