"""Trainer-level checkpoints: ``default_local_dir/global_step_N/{actor,critic,data.pt}``.

A save marks step N incomplete, writes every part of it (the workers' directories, all ranks returned;
then ``data.pt``), records every file's size and hash in ``checkpoint_manifest.json``, and moves
``latest_checkpointed_iteration.txt`` last (atomic renames), so a crash in the middle of a save leaves
the previous checkpoint as the one that resume finds. ``data.pt`` holds the dataloader position and the
trainer's own state (KL coefficient, the last rollout log-prob parity check).

Resume (``trainer.resume_mode``): ``auto`` takes the tracker's step if its files match its manifest,
else the newest older complete step, and says so in one line; without a tracker it scans the step
directories; with no complete step it raises :class:`CheckpointDamagedError` naming the damage.
``resume_path`` refuses a damaged step the same way. A step saved before manifests is checked for what
can be checked without one (``hybridflow/utils/checkpoint/manifest.py``).

Before the first step, :meth:`TrainerCheckpointer.preflight` creates the directory, proves it writable
and compares its free space with :func:`estimate_checkpoint_bytes`. A save that still fails (the disk
filled up meanwhile) removes what it wrote of step N and raises :class:`CheckpointSaveError` in one
line; the tracker still names the previous checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch

from hybridflow.utils.checkpoint.manifest import (
    CheckpointDamagedError,
    begin_manifest,
    check_step,
    manifest_shows_damage,
    record_pruned_role,
    write_manifest,
)
from hybridflow.utils.checkpoint.preflight import (
    CheckpointSaveError,
    probe_checkpoint_dir,
    remove_partial,
    root_cause,
)
from hybridflow.utils.checkpoint.tracker import (
    STEP_DIR_PATTERN,
    atomic_torch_save,
    find_resumable_checkpoint,
    global_step_dir,
    list_step_dirs,
    read_latest_checkpointed_iteration,
    write_latest_checkpointed_iteration,
)

# Free space asked for on top of the estimate: DCP metadata, data.pt, filesystem rounding.
SPACE_MARGIN = 1.1
ADAM_STATES = 2  # exp_avg and exp_avg_sq, each the size of the trainable parameter
EXTRA_STATE_BYTES = 16 * 1024  # per rank: RNG states and the lr scheduler (measured ~14.4 KiB)
DCP_BYTES_PER_TENSOR_RANK = 1536
DCP_METADATA_BYTES_PER_TENSOR = 2048


class TrainerCheckpointer:
    """``trainer`` config section: save_freq, default_local_dir, resume_mode, resume_from_path,
    max_actor_ckpt_to_keep, max_critic_ckpt_to_keep."""

    def __init__(self, trainer_cfg) -> None:
        self.cfg = trainer_cfg
        self.root = os.path.expanduser(str(trainer_cfg.default_local_dir))

    def saves(self) -> bool:
        """Whether this run may write a checkpoint (periodically, or when preempted)."""
        return int(self.cfg.get("save_freq") or -1) > 0 or bool(self.cfg.get("save_on_preempt", True))

    def preflight(self, config) -> None:
        """Before any step: the directory exists, takes writes, and has room for one checkpoint
        (:class:`~hybridflow.utils.checkpoint.preflight.CheckpointDirError` otherwise)."""
        if self.saves():
            probe_checkpoint_dir(self.root, estimate_checkpoint_bytes(config))

    def save(self, trainer) -> str:
        """Write step N's checkpoint and point the tracker at it. On failure: remove what was written
        of step N and raise :class:`CheckpointSaveError` (one line); the tracker is not moved."""
        step = trainer.global_steps
        step_dir = global_step_dir(self.root, step)
        try:
            begin_manifest(step_dir, step)  # a step half re-saved is never taken for complete
            self._write(trainer, step, step_dir)
            write_manifest(step_dir, step)  # every worker has returned and data.pt is written
            write_latest_checkpointed_iteration(self.root, step)
        except Exception as err:
            space = _low_space_note(self.root)  # before the clean-up frees what the save wrote
            self._discard(step, step_dir)
            kept = self.latest() or "none: no checkpoint was saved yet"
            raise CheckpointSaveError(
                f"saving the checkpoint of step {step} to {step_dir} failed: {root_cause(err)}{space}; its "
                f"partial files were removed; the checkpoint a resume finds is {kept}"
            ) from None
        self.prune(protect=step)
        return step_dir

    def _discard(self, step: int, step_dir: str) -> None:
        """Remove the partial step directory, or, if the tracker already names this step (a rerun
        re-saving it), only the half-written parts next to its complete ones (its manifest stays marked
        incomplete: a resume falls back to the step before)."""
        if read_latest_checkpointed_iteration(self.root) != step:
            remove_partial(step_dir)
            return
        for role in ("actor", "critic"):
            for suffix in (".tmp", ".old"):
                remove_partial(os.path.join(step_dir, role + suffix))

    def _write(self, trainer, step: int, step_dir: str) -> None:
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

    def prune(self, protect: int) -> list[str]:
        """``max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep`` (verl): keep the newest N ``actor`` /
        ``critic`` directories each (None or <= 0: all); a step directory left with neither goes
        whole. ``global_step_{protect}``, the one the tracker names, is never touched. A step whose
        manifest shows damage neither counts toward N nor is touched, so a damaged step never pushes
        out a complete one. Returns the removed paths."""
        limits = {role: int(self.cfg.get(f"max_{role}_ckpt_to_keep") or 0) for role in ("actor", "critic")}
        steps = list_step_dirs(self.root)
        if any(keep > 0 for keep in limits.values()):
            steps = {s: p for s, p in steps.items() if s == protect or not manifest_shows_damage(p)}
        removed = []
        for role, keep in limits.items():
            kept = 0
            for step in sorted(steps, reverse=True) if keep > 0 else []:
                path = os.path.join(steps[step], role)
                if not os.path.isdir(path):
                    continue
                if step == protect or kept < keep:
                    kept += 1
                    continue
                shutil.rmtree(path)
                removed.append(path)
                record_pruned_role(steps[step], role)
        for step, path in steps.items():
            holds_model = any(os.path.isdir(os.path.join(path, role)) for role in limits)
            if step != protect and not holds_model and any(p.startswith(path + os.sep) for p in removed):
                shutil.rmtree(path)  # only data.pt is left: not resumable on its own
                removed.append(path)
        return removed

    def latest(self) -> str | None:
        """The checkpoint a resume (``resume_mode=auto``) would load now, or None (none, or none
        complete)."""
        try:
            choice = find_resumable_checkpoint(self.root, roles=())
        except (CheckpointDamagedError, OSError):
            return None
        return None if choice is None else choice.path

    def resume_path(self, roles=("actor",)) -> str | None:
        """The step directory to resume from (None: start afresh); ``roles``: the worker directories the
        resume loads. Raises :class:`CheckpointDamagedError` for a damaged ``resume_from_path`` and when
        ``auto`` finds step directories but none complete; prints one line when ``auto`` falls back."""
        mode = self.cfg.get("resume_mode", "auto")
        if mode == "disable":
            return None
        if mode == "resume_path":
            path = self.cfg.get("resume_from_path")
            if not path or not os.path.isdir(os.path.expanduser(path)):
                raise FileNotFoundError(
                    f"trainer.resume_mode=resume_path but resume_from_path={path!r} is not a directory"
                )
            path = os.path.normpath(os.path.expanduser(path))
            match = STEP_DIR_PATTERN.match(os.path.basename(path))
            check = check_step(path, roles, int(match.group(1)) if match else None)
            if not check.complete:
                raise CheckpointDamagedError(
                    f"trainer.resume_from_path: checkpoint {check.describe()}; point resume_from_path at a "
                    "complete step, or use trainer.resume_mode=auto to take the newest complete one"
                )
            if check.legacy:
                print(f"hybridflow: {check.legacy_note()}", flush=True)
            return path
        if mode != "auto":
            raise ValueError(f"trainer.resume_mode must be auto, disable or resume_path, not {mode!r}")
        choice = find_resumable_checkpoint(self.root, roles)
        if choice is None:
            return None
        if choice.note:
            print(f"hybridflow: {choice.note}", flush=True)
        return choice.path

    def load(self, trainer) -> int:
        """Restore workers, dataloader and trainer state; returns the step to continue after (0: fresh)."""
        path = self.resume_path(("actor", "critic") if trainer.wg.critic is not None else ("actor",))
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


def _low_space_note(path: str) -> str:
    """`` (0.0 MiB free there when it failed)`` when under 1 GiB is free: a full disk can surface as an
    error that does not say so (a torch.save cut short)."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f" ({free / 2**20:.1f} MiB free there when it failed)" if free < 2**30 else ""


@dataclasses.dataclass(frozen=True)
class _Saved:
    """What a model's checkpoint holds: model-state and trainable tensors (count and elements)."""

    model_tensors: int
    model_numel: int
    trainable_tensors: int
    trainable_numel: int


def _saved_tensors(model_cfg, kind: str, lora: bool) -> _Saved:
    """Counted on a model built on the meta device (no memory, no weights read). The model state counts
    tied weights twice, as ``get_model_state_dict`` saves them; a LoRA actor saves only its adapter."""
    import transformers

    from hybridflow.workers.model_builder import auto_class_name

    trust = bool(model_cfg.get("trust_remote_code", False))
    hf_config = transformers.AutoConfig.from_pretrained(
        os.path.expanduser(str(model_cfg.path)), trust_remote_code=trust
    )
    for key, value in (model_cfg.get("override_config") or {}).items():
        setattr(hf_config, key, value)
    if kind != "causal_lm":
        hf_config.num_labels = 1
    auto_cls = getattr(transformers, auto_class_name(hf_config, kind))
    with torch.device("meta"):
        model = auto_cls.from_config(hf_config, trust_remote_code=trust)
        if lora:
            from hybridflow.workers.lora import apply_lora

            model = apply_lora(model, model_cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = list(trainable) if lora else list(model.state_dict().values())
    return _Saved(
        len(state), sum(t.numel() for t in state), len(trainable), sum(p.numel() for p in trainable)
    )


def _role_bytes(model_cfg, fsdp_cfg, contents, kind: str, lora: bool, world_size: int) -> int:
    """Model tensors in ``model_dtype`` (a LoRA adapter: fp32), AdamW's two states and step per
    trainable tensor, each rank's RNG/scheduler file, and DCP's per-tensor records (measured ~1.5 KiB
    per tensor and rank in the shards plus ~2 KiB per tensor in ``.metadata``)."""
    from hybridflow.workers.fsdp_utils import to_dtype

    saved = _saved_tensors(model_cfg, kind, lora)
    width = 4 if lora else torch.empty((), dtype=to_dtype(fsdp_cfg.get("model_dtype", "fp32"))).element_size()
    total, tensors = 0, 0
    if "model" in contents:
        total += saved.model_numel * width
        tensors += saved.model_tensors
    if "optimizer" in contents:
        total += saved.trainable_numel * ADAM_STATES * width
        tensors += saved.trainable_tensors * (ADAM_STATES + 1)
    if "extra" in contents:
        total += EXTRA_STATE_BYTES * world_size
    return total + tensors * (DCP_BYTES_PER_TENSOR_RANK * world_size + DCP_METADATA_BYTES_PER_TENSOR)


def _small_files_bytes(model_dir: str) -> int:
    """Config and tokenizer files (each checkpoint's ``huggingface/`` copy): the model directory minus
    its weight files."""
    weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
    total = 0
    for dirpath, _, files in os.walk(os.path.expanduser(model_dir)):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files if not f.endswith(weights))
    return total


def estimate_checkpoint_bytes(config) -> int:
    """Bytes one ``global_step_N`` takes (what ``FSDPCheckpointManager`` writes): per trained model
    (actor, critic), the saved parameters in ``model_dtype`` plus AdamW's two states per trainable
    parameter (:func:`_role_bytes`), plus the ``huggingface/`` config and tokenizer files; times
    :data:`SPACE_MARGIN`."""
    from hybridflow.utils.roles import need_critic

    world = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    actor_model = config.actor_rollout_ref.model
    actor = config.actor_rollout_ref.actor
    lora = int(actor_model.get("lora_rank", 0) or 0) > 0
    contents = list(actor.checkpoint.save_contents)
    total = _role_bytes(actor_model, actor.fsdp_config, contents, "causal_lm", lora, world)
    total += _small_files_bytes(actor_model.path)
    if need_critic(config):
        critic = config.critic
        contents = list(critic.checkpoint.save_contents)
        total += _role_bytes(critic.model, critic.model.fsdp_config, contents, "token_value", False, world)
        total += _small_files_bytes(critic.model.path)
    return int(total * SPACE_MARGIN)
