"""Checkpointing: FSDP2 shards via torch.distributed.checkpoint, plus the trainer's step tracker and each
step's manifest (manifest.py: every file's size and hash, checked at resume).

``from hybridflow.utils.checkpoint import FSDPCheckpointManager`` imports torch.distributed lazily; the
tracker functions (tracker.py) import torch only inside ``atomic_torch_save``.
"""

from hybridflow.utils.checkpoint.manifest import CheckpointDamagedError, check_step, write_manifest
from hybridflow.utils.checkpoint.tracker import (
    atomic_torch_save,
    find_latest_ckpt_path,
    find_resumable_checkpoint,
    global_step_dir,
    prune_checkpoints,
    read_latest_checkpointed_iteration,
    write_latest_checkpointed_iteration,
)

__all__ = [
    "CheckpointDamagedError",
    "FSDPCheckpointManager",
    "atomic_torch_save",
    "check_step",
    "find_latest_ckpt_path",
    "find_resumable_checkpoint",
    "global_step_dir",
    "prune_checkpoints",
    "read_latest_checkpointed_iteration",
    "write_latest_checkpointed_iteration",
    "write_manifest",
]


def __getattr__(name: str):
    if name == "FSDPCheckpointManager":
        from hybridflow.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        return FSDPCheckpointManager
    raise AttributeError(f"module 'hybridflow.utils.checkpoint' has no attribute {name!r}")
