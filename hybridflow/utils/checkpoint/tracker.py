"""Trainer-level checkpoint bookkeeping in verl's layout.

    default_local_dir/
      latest_checkpointed_iteration.txt    the step of the newest *complete* checkpoint, e.g. "8"
      global_step_4/{actor,critic,data.pt}
      global_step_8/{actor,critic,data.pt}

The tracker file is the commit point: the trainer writes every part of step N (each worker's directory via
FSDPCheckpointManager, the dataloader state via ``atomic_torch_save``) and only then moves the tracker to N.
A crash anywhere before that leaves the tracker on the previous step, whose directory is untouched, so
``find_latest_ckpt_path`` always returns a loadable checkpoint. Every write here is temp file + ``os.replace``
(atomic on POSIX within one filesystem).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Any

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def global_step_dir(default_local_dir: str, step: int) -> str:
    """``default_local_dir/global_step_{step}``."""
    return os.path.join(default_local_dir, f"global_step_{step}")


def _atomic_write(path: str, write_fn) -> None:
    """Call ``write_fn(file_object)`` on a temp file next to ``path``, fsync it, then rename onto ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` that never leaves a truncated file at ``path`` (temp file + rename)."""
    import torch

    _atomic_write(path, lambda f: torch.save(obj, f))


def write_latest_checkpointed_iteration(default_local_dir: str, step: int) -> None:
    """Atomically point the tracker file at ``step``; call only after every part of that step is written."""
    _atomic_write(os.path.join(default_local_dir, TRACKER_FILE), lambda f: f.write(str(int(step)).encode()))


def read_latest_checkpointed_iteration(default_local_dir: str) -> int | None:
    """The step recorded in the tracker file, or None when there is no tracker file."""
    path = os.path.join(default_local_dir, TRACKER_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"Corrupt checkpoint tracker {path}: expected a step number, got {text!r}") from None


def find_latest_ckpt_path(default_local_dir: str) -> str | None:
    """Path of ``global_step_{latest}``; None without a tracker file; FileNotFoundError if it is missing."""
    step = read_latest_checkpointed_iteration(default_local_dir)
    if step is None:
        return None
    path = global_step_dir(default_local_dir, step)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{os.path.join(default_local_dir, TRACKER_FILE)} points to step {step} but {path} does not exist"
        )
    return path


def list_step_dirs(default_local_dir: str) -> dict[int, str]:
    """``{step: path}`` for every ``global_step_N`` directory directly under ``default_local_dir``."""
    if not os.path.isdir(default_local_dir):
        return {}
    steps = {}
    for name in os.listdir(default_local_dir):
        match = _STEP_DIR.match(name)
        path = os.path.join(default_local_dir, name)
        if match and os.path.isdir(path):
            steps[int(match.group(1))] = path
    return steps


def prune_checkpoints(default_local_dir: str, keep: int | None, protect: int) -> list[str]:
    """Delete all but the newest ``keep`` ``global_step_N`` directories (by N); returns the removed paths.

    ``keep=None`` (or <= 0) keeps everything. ``global_step_{protect}`` (the step just written, which the
    tracker points to) is never deleted, even when newer directories exist from an abandoned run.
    """
    if keep is None or keep <= 0:
        return []
    steps = list_step_dirs(default_local_dir)
    newest_first = sorted(steps, reverse=True)
    removed = []
    for step in newest_first[keep:]:
        if step == protect:
            continue
        shutil.rmtree(steps[step])
        removed.append(steps[step])
    return removed
