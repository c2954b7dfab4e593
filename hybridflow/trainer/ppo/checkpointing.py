"""Trainer-level checkpoints: ``default_local_dir/global_step_N/{actor,critic,data.pt}``.

A save writes every part of step N first and moves ``latest_checkpointed_iteration.txt`` last (an
atomic rename), so a crash in the middle of a save leaves the previous checkpoint as the one that
resume finds. ``data.pt`` holds the dataloader position and the trainer's own state (KL coefficient,
the last rollout log-prob parity check).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch

from hybridflow.utils.checkpoint.tracker import (
    atomic_torch_save,
    find_latest_ckpt_path,
    global_step_dir,
    list_step_dirs,
    write_latest_checkpointed_iteration,
)


class TrainerCheckpointer:
    """``trainer`` config section: save_freq, default_local_dir, resume_mode, resume_from_path,
    max_actor_ckpt_to_keep, max_critic_ckpt_to_keep."""

    def __init__(self, trainer_cfg) -> None:
        self.cfg = trainer_cfg
        self.root = os.path.expanduser(str(trainer_cfg.default_local_dir))

    def save(self, trainer) -> str:
        step = trainer.global_steps
        step_dir = global_step_dir(self.root, step)
        trainer.wg.actor_rollout.save_checkpoint(os.path.join(step_dir, "actor"), step, None)
        if trainer.wg.critic is not None:
            trainer.wg.critic.save_checkpoint(os.path.join(step_dir, "critic"), step, None)
        state = {
            "dataloader": trainer.train_dataloader.state_dict(),
            "global_steps": step,
            "kl_coef": trainer.kl_ctrl.value,
            # rollout.use_rollout_log_probs: the last parity check, so a resume trusts/re-checks alike
            "rollout_log_probs_verified": trainer.log_prob_parity.verified,
            "rollout_log_probs_checked_at": trainer.log_prob_parity.checked_at,
        }
        atomic_torch_save(state, os.path.join(step_dir, "data.pt"))
        write_latest_checkpointed_iteration(self.root, step)
        self.prune(protect=step)
        return step_dir

    def prune(self, protect: int) -> list[str]:
        """``max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep`` (verl): keep the newest N ``actor`` /
        ``critic`` directories each (None or <= 0: all); a step directory left with neither goes
        whole. ``global_step_{protect}``, the one the tracker names, is never touched. Returns the
        removed paths."""
        limits = {role: int(self.cfg.get(f"max_{role}_ckpt_to_keep") or 0) for role in ("actor", "critic")}
        steps = list_step_dirs(self.root)
        removed = []
        for role, keep in limits.items():
            for step in sorted(steps, reverse=True)[keep:] if keep > 0 else []:
                path = os.path.join(steps[step], role)
                if step != protect and os.path.isdir(path):
                    shutil.rmtree(path)
                    removed.append(path)
        for step, path in steps.items():
            holds_model = any(os.path.isdir(os.path.join(path, role)) for role in limits)
            if step != protect and not holds_model and any(p.startswith(path + os.sep) for p in removed):
                shutil.rmtree(path)  # only data.pt is left: not resumable on its own
                removed.append(path)
        return removed

    def resume_path(self) -> str | None:
        mode = self.cfg.get("resume_mode", "auto")
        if mode == "disable":
            return None
        if mode == "resume_path":
            path = self.cfg.get("resume_from_path")
            if not path or not os.path.isdir(os.path.expanduser(path)):
                raise FileNotFoundError(
                    f"trainer.resume_mode=resume_path but resume_from_path={path!r} is not a directory"
                )
            return os.path.expanduser(path)
        if mode != "auto":
            raise ValueError(f"trainer.resume_mode must be auto, disable or resume_path, not {mode!r}")
        return find_latest_ckpt_path(self.root)

    def load(self, trainer) -> int:
        """Restore workers, dataloader and trainer state; returns the step to continue after (0: fresh)."""
        path = self.resume_path()
        if path is None:
            return 0
        state = torch.load(os.path.join(path, "data.pt"), weights_only=False)
        trainer.wg.actor_rollout.load_checkpoint(os.path.join(path, "actor"))
        if trainer.wg.critic is not None:
            trainer.wg.critic.load_checkpoint(os.path.join(path, "critic"))
        trainer.train_dataloader.load_state_dict(state["dataloader"])
        trainer.kl_ctrl.value = state["kl_coef"]
        trainer.log_prob_parity = dataclasses.replace(  # older checkpoints: check again
            trainer.log_prob_parity,
            verified=bool(state.get("rollout_log_probs_verified", False)),
            checked_at=int(state.get("rollout_log_probs_checked_at", 0)),
        )
        print(f"resumed from {path} (step {state['global_steps']})")
        return int(state["global_steps"])
