"""Save and restore the training state of an FSDP2 (``fully_shard``) model with torch.distributed.checkpoint.

One checkpoint directory ``local_path`` (in the trainer: ``default_local_dir/global_step_N/actor``) holds::

    local_path/
      model/                     DCP: the sharded model state dict, keys are the plain HF names
        .metadata                  ("model.layers.0.mlp.up_proj.weight"), one __{rank}_0.distcp per rank
      optim/                     DCP: optimizer state keyed by parameter name (get_optimizer_state_dict)
      extra_state_rank_{r}.pt    per rank: lr_scheduler.state_dict(), RNG states (python, numpy, torch, cuda)
      huggingface/               rank 0: config.json, generation_config.json, tokenizer/processor files
      checkpoint_meta.json       rank 0, written last: global_step, world_size, model_class, dtype, contents

With ``trainable_only`` (a LoRA actor) ``model/`` holds only the parameters that train (the adapter,
under peft's names), ``huggingface/lora_adapter/adapter_config.json`` records the adapter and the base
model's path, and the meta says ``"trainable_only": true``; the frozen base weights stay where they were
loaded from.

Model and optimizer get separate DCP directories so the merger (``hybridflow.model_merger``) reads weights
without touching optimizer shards, and a model-only checkpoint has the same layout minus ``optim/``.

Atomicity: all ranks write into the sibling ``{local_path}.tmp``; after a barrier rank 0 writes
checkpoint_meta.json and renames the directory onto ``local_path``. A save that raises (a full disk) has
rank 0 delete the ``.tmp`` before the error propagates; a killed save leaves only a stale ``.tmp``
(cleared by the next save). Either way ``local_path`` is either the old checkpoint or the new one. A rename
cannot replace a non-empty directory, so re-saving to an existing path moves the old directory aside
(``.old``) just before the rename and deletes it after; trainers avoid even that window by writing each step
to a new ``global_step_N`` directory and moving the tracker file last (tracker.py).

Resharding: DCP records global tensor shapes, so a checkpoint saved at world size W loads at any world size
(tested: 2 -> 1). RNG states are per rank; a rank with no file of its own takes rank 0's, with a warning.
Tensors are never moved to a device here: DTensor shards go to disk from wherever they live (CPU/gloo or
CUDA/NCCL) and load back into the live model's shards.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import shutil
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

logger = logging.getLogger(__name__)

CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")
META_FILE = "checkpoint_meta.json"
MODEL_DIR = "model"
OPTIM_DIR = "optim"
HF_DIR = "huggingface"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def extra_state_file(rank: int) -> str:
    return f"extra_state_rank_{rank}.pt"


def get_rng_state() -> dict[str, Any]:
    """RNG states of python ``random``, numpy, torch CPU and (if available) the current CUDA device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``get_rng_state``."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def read_checkpoint_meta(local_path: str | os.PathLike) -> dict[str, Any]:
    """Load ``checkpoint_meta.json``; FileNotFoundError naming the path if it is absent or partial."""
    local_path = os.fspath(local_path)
    if not os.path.isdir(local_path):
        raise FileNotFoundError(f"Checkpoint directory {local_path} does not exist")
    meta_path = os.path.join(local_path, META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(
            f"Checkpoint {local_path} is incomplete: no {META_FILE} (the save was interrupted or this is not "
            "an FSDPCheckpointManager checkpoint)"
        )
    with open(meta_path) as f:
        return json.load(f)


ADAPTER_DIR = "lora_adapter"


def unwrapped_model_class(model: torch.nn.Module) -> type:
    """The model's own class: ``fully_shard`` swaps in a subclass named ``FSDP<Class>``; an adapter
    wrapper with ``get_base_model()`` (peft) counts as the model it wraps."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        model = model.get_base_model()
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def _replace_dir(src: str, dst: str) -> None:
    """Move directory ``src`` onto ``dst``; an existing ``dst`` is set aside and deleted only afterwards."""
    if not os.path.exists(dst):
        os.replace(src, dst)
        return
    old = dst + ".old"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old)


class FSDPCheckpointManager:
    """Collective save/load of an FSDP2 model, its optimizer, lr scheduler and RNG states (see module doc).

    Args:
        model: the ``fully_shard``-ed module (a Hugging Face model for the ``huggingface/`` files).
        optimizer: saved/loaded when given and ``"optimizer"`` is in ``checkpoint_contents``.
        lr_scheduler: its ``state_dict()`` goes into the per-rank extra state.
        processing_class: tokenizer or processor, saved under ``huggingface/`` on rank 0.
        checkpoint_contents: subset of ``("model", "optimizer", "extra")`` to save and to load.
        trainable_only: save and load only parameters with ``requires_grad`` (a LoRA adapter).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        processing_class: Any | None = None,
        checkpoint_contents: tuple[str, ...] | list[str] = CHECKPOINT_CONTENTS,
        trainable_only: bool = False,
    ):
        unknown = set(checkpoint_contents) - set(CHECKPOINT_CONTENTS)
        if unknown:
            raise ValueError(f"Unknown checkpoint contents {sorted(unknown)}; known: {CHECKPOINT_CONTENTS}")
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class
        self.checkpoint_contents = tuple(checkpoint_contents)
        self.trainable_only = trainable_only
        # (global_step, local_path) of the checkpoints this manager wrote, for max_ckpt_to_keep.
        self.saved_checkpoints: list[tuple[int, str]] = []

    def _model_state(self) -> dict[str, Any]:
        """The model state dict DCP saves and loads (only the trainable entries with ``trainable_only``)."""
        state = get_model_state_dict(self.model)
        if not self.trainable_only:
            return state
        trainable = {name for name, param in self.model.named_parameters() if param.requires_grad}
        return {key: value for key, value in state.items() if key in trainable}

    @property
    def _with_optimizer(self) -> bool:
        return self.optimizer is not None and "optimizer" in self.checkpoint_contents

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, local_path: str, global_step: int, max_ckpt_to_keep: int | None = None) -> None:
        """Write a checkpoint to ``local_path``; every rank must call this (collective). If it raises,
        rank 0 has removed the partial ``{local_path}.tmp``."""
        local_path = os.path.normpath(os.fspath(local_path))
        tmp_path = local_path + ".tmp"
        try:
            self._save(local_path, tmp_path, global_step, max_ckpt_to_keep)
        except Exception:
            if _rank() == 0:  # partial shards would only fill the disk (the caller may be out of space)
                shutil.rmtree(tmp_path, ignore_errors=True)
            raise

    def _save(self, local_path: str, tmp_path: str, global_step: int, max_ckpt_to_keep: int | None) -> None:
        rank = _rank()
        if rank == 0:  # a stale .tmp is what an earlier interrupted save left behind
            shutil.rmtree(tmp_path, ignore_errors=True)
            os.makedirs(tmp_path)
        _barrier()

        if "model" in self.checkpoint_contents:
            dcp.save(self._model_state(), checkpoint_id=os.path.join(tmp_path, MODEL_DIR))
        if self._with_optimizer:
            optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
            dcp.save(optim_sd, checkpoint_id=os.path.join(tmp_path, OPTIM_DIR))
        if "extra" in self.checkpoint_contents:
            torch.save(self._extra_state(), os.path.join(tmp_path, extra_state_file(rank)))
        if rank == 0:
            self._save_hf_files(os.path.join(tmp_path, HF_DIR))
        _barrier()  # every rank's files are on disk before rank 0 declares the checkpoint complete

        if rank == 0:
            self._write_meta(tmp_path, global_step)
            _replace_dir(tmp_path, local_path)
            logger.info("Saved checkpoint of step %d to %s", global_step, local_path)
        self._record_and_prune(local_path, global_step, max_ckpt_to_keep, delete=rank == 0)
        _barrier()  # nobody returns (and e.g. moves the tracker) before the directory is in place

    def _extra_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"rng": get_rng_state()}
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        return state

    def _save_hf_files(self, hf_dir: str) -> None:
        """Config, generation config and tokenizer: enough for the merger to rebuild the model."""
        config = getattr(self.model, "config", None)
        if config is not None:
            config = copy.deepcopy(config)  # do not mutate the live config
            config.architectures = [unwrapped_model_class(self.model).__name__]
            config.save_pretrained(hf_dir)
        generation_config = getattr(self.model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(hf_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(hf_dir)
        for name, adapter_config in (getattr(self.model, "peft_config", None) or {}).items():
            adapter_config.save_pretrained(os.path.join(hf_dir, ADAPTER_DIR if name == "default" else name))

    def _write_meta(self, path: str, global_step: int) -> None:
        contents = [c for c in self.checkpoint_contents if c != "optimizer" or self._with_optimizer]
        param = next(self.model.parameters(), None)
        meta = {
            "global_step": int(global_step),
            "world_size": _world_size(),
            "model_class": unwrapped_model_class(self.model).__name__,
            "dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
            "contents": contents,
            "trainable_only": self.trainable_only,
        }
        with open(os.path.join(path, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())

    def _record_and_prune(self, local_path: str, global_step: int, keep: int | None, delete: bool) -> None:
        """Keep only the newest ``keep`` checkpoints (by step) this manager wrote; never the one just written.

        An emptied ``global_step_N`` parent (all its workers pruned) is removed too.
        """
        others = sorted(((s, p) for s, p in self.saved_checkpoints if p != local_path), reverse=True)
        if keep is None or keep <= 0:
            kept, dropped = others, []
        else:
            kept, dropped = others[: keep - 1], others[keep - 1 :]
        for _, path in dropped if delete else []:
            shutil.rmtree(path, ignore_errors=True)
            parent = os.path.dirname(path)
            if os.path.basename(parent).startswith("global_step_") and os.path.isdir(parent):
                if not os.listdir(parent):
                    os.rmdir(parent)
        self.saved_checkpoints = sorted([*kept, (global_step, local_path)])

    # ------------------------------------------------------------------ load
    def load_checkpoint(self, local_path: str) -> dict[str, Any]:
        """Restore what ``checkpoint_contents`` names from ``local_path`` (collective); returns the meta."""
        local_path = os.path.normpath(os.fspath(local_path))
        meta = read_checkpoint_meta(local_path)
        saved = set(meta["contents"])
        if meta["world_size"] != _world_size():
            logger.info(
                "Resharding %s: saved at world size %d, loading at %d",
                local_path,
                meta["world_size"],
                _world_size(),
            )
        wanted = {c for c in self.checkpoint_contents if c != "optimizer" or self._with_optimizer}
        if wanted - saved:
            raise ValueError(
                f"Checkpoint {local_path} lacks {sorted(wanted - saved)} (it holds {sorted(saved)}); "
                "pass checkpoint_contents without them to load the rest"
            )

        if meta.get("trainable_only", False) != self.trainable_only:
            raise ValueError(
                f"Checkpoint {local_path} has trainable_only={meta.get('trainable_only', False)} "
                f"(adapter-only: a LoRA run) but this model has trainable_only={self.trainable_only}; "
                "resume with the same actor_rollout_ref.model.lora_rank setting"
            )
        if "model" in wanted:
            model_sd = self._model_state()
            dcp.load(model_sd, checkpoint_id=os.path.join(local_path, MODEL_DIR))
            set_model_state_dict(
                self.model, model_sd, options=StateDictOptions(strict=not self.trainable_only)
            )
        if "optimizer" in wanted:
            optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
            dcp.load(optim_sd, checkpoint_id=os.path.join(local_path, OPTIM_DIR))
            set_optimizer_state_dict(self.model, self.optimizer, optim_sd)
        if "extra" in wanted:
            self._load_extra_state(local_path)
        logger.info("Loaded checkpoint of step %s from %s", meta["global_step"], local_path)
        return meta

    def _load_extra_state(self, local_path: str) -> None:
        path = os.path.join(local_path, extra_state_file(_rank()))
        if not os.path.isfile(path):  # loading at a larger world size than the save
            warnings.warn(
                f"{path} not found; rank {_rank()} restores rank 0's RNG and scheduler state instead",
                stacklevel=3,
            )
            path = os.path.join(local_path, extra_state_file(0))
        # weights_only=False: the numpy RNG state holds an ndarray; this file is one we wrote ourselves.
        state = torch.load(path, map_location="cpu", weights_only=False)
        if self.lr_scheduler is not None:
            if "lr_scheduler" not in state:
                raise ValueError(f"{path} holds no lr_scheduler state but this manager has an lr_scheduler")
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        set_rng_state(state["rng"])
