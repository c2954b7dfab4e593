"""Trainer-level checkpoint bookkeeping in verl's layout.

    default_local_dir/
      latest_checkpointed_iteration.txt    the step of the newest *complete* checkpoint, e.g. "8"
      global_step_4/{actor,critic,data.pt,checkpoint_manifest.json}
      global_step_8/{actor,critic,data.pt,checkpoint_manifest.json}

The tracker file is the commit point: the trainer writes every part of step N (each worker's directory via
FSDPCheckpointManager, the dataloader state via ``atomic_torch_save``), then the step's manifest (every
file's size and hash, manifest.py), and only then moves the tracker to N. A crash anywhere before that
leaves the tracker on the previous step, whose directory is untouched. Every write here is temp file +
``os.replace`` (atomic on POSIX within one filesystem).

A step can still be damaged afterwards (a disk error, a copy cut short, a file edited by hand):
:func:`find_resumable_checkpoint` checks the tracker's step against its manifest and falls back to the
newest older step that is complete, saying so in one line; without a tracker it scans the
``global_step_N`` directories. :func:`find_latest_ckpt_path` is verl's plain tracker lookup.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

from hybridflow.utils.checkpoint.manifest import (
    CheckpointDamagedError,
    check_step,
    manifest_shows_damage,
)
from hybridflow.utils.checkpoint.manifest import atomic_write as _atomic_write

TRACKER_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR_PATTERN = re.compile(r"^global_step_(\d+)$")


def global_step_dir(default_local_dir: str, step: int) -> str:
    """``default_local_dir/global_step_{step}``."""
    return os.path.join(default_local_dir, f"global_step_{step}")


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
    """Path of ``global_step_{latest}``; None without a tracker file; FileNotFoundError if it is missing.
    Checks nothing else: a resume goes through :func:`find_resumable_checkpoint`."""
    step = read_latest_checkpointed_iteration(default_local_dir)
    if step is None:
        return None
    path = global_step_dir(default_local_dir, step)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{os.path.join(default_local_dir, TRACKER_FILE)} points to step {step} but {path} does not exist"
        )
    return path


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a resume loads (``path`` of ``global_step_{step}``), and the one line to print about
    the choice when it is not simply the tracker's complete step (``note``; None otherwise)."""

    path: str
    step: int
    note: str | None


def find_resumable_checkpoint(default_local_dir: str, roles=("actor",)) -> ResumeChoice | None:
    """The newest complete checkpoint (``trainer.resume_mode=auto``); ``roles``: the worker directories
    the resume loads. None when there is nothing to resume (no tracker, no step directory).

    The tracker's step is checked against its manifest (manifest.py, nothing is loaded); when damaged, the
    older steps are tried newest first. Without a tracker file (or with an unreadable one) every
    ``global_step_N`` is a candidate, newest first; steps newer than the tracker's are never used (their
    save did not finish). Raises :class:`CheckpointDamagedError` naming every damaged step when none is
    complete."""
    steps = list_step_dirs(default_local_dir)
    tracker = os.path.join(default_local_dir, TRACKER_FILE)
    try:
        tracked = read_latest_checkpointed_iteration(default_local_dir)
        found = None
    except ValueError as err:
        tracked, found = None, f"{tracker} is unreadable ({err})"
    if tracked is None and not steps:
        return None
    if tracked is None:
        found = (found or f"no {tracker}") + f"; found step directories {', '.join(map(str, sorted(steps)))}"
        candidates = sorted(steps, reverse=True)
    else:
        candidates = [tracked] + sorted((s for s in steps if s < tracked), reverse=True)
    damaged = []
    for step in candidates:
        check = check_step(steps.get(step, global_step_dir(default_local_dir, step)), roles, step)
        if not check.complete:
            damaged.append(check)
            continue
        parts = [found] if found else []
        if damaged:
            names = ", ".join(str(d.step) for d in damaged)
            details = "; ".join(d.describe() for d in damaged)
            steps_are = "steps {} are" if len(damaged) > 1 else "step {} is"
            parts.append(f"checkpoint {steps_are.format(names)} damaged ({details})")
        if check.legacy:
            parts.append(check.legacy_note())
        note = None
        if parts:
            note = "; ".join(parts) + f"; resuming from step {step} ({check.path})"
            note += " instead" if damaged else ""
        return ResumeChoice(check.path, step, note)
    details = " | ".join(d.describe() for d in damaged)
    raise CheckpointDamagedError(
        f"trainer.resume_mode=auto: no complete checkpoint to resume from in {default_local_dir}"
        f"{' (' + found + ')' if found else ''}: {details}; restore the damaged files, move the damaged "
        "step directories away, or start afresh with trainer.resume_mode=disable"
    )


def list_step_dirs(default_local_dir: str) -> dict[int, str]:
    """``{step: path}`` for every ``global_step_N`` directory directly under ``default_local_dir``."""
    if not os.path.isdir(default_local_dir):
        return {}
    steps = {}
    for name in os.listdir(default_local_dir):
        match = STEP_DIR_PATTERN.match(name)
        path = os.path.join(default_local_dir, name)
        if match and os.path.isdir(path):
            steps[int(match.group(1))] = path
    return steps


def prune_checkpoints(default_local_dir: str, keep: int | None, protect: int) -> list[str]:
    """Delete all but the newest ``keep`` ``global_step_N`` directories (by N); returns the removed paths.

    ``keep=None`` (or <= 0) keeps everything. ``global_step_{protect}`` (the step just written, which the
    tracker points to) is never deleted, even when newer directories exist from an abandoned run. A step
    whose manifest shows damage neither counts toward ``keep`` nor is deleted (so it cannot push out a
    complete one).
    """
    if keep is None or keep <= 0:
        return []
    steps = list_step_dirs(default_local_dir)
    removed, kept = [], 0
    for step in sorted(steps, reverse=True):
        if step != protect and manifest_shows_damage(steps[step]):
            continue
        if step == protect or kept < keep:
            kept += 1
        else:
            shutil.rmtree(steps[step])
            removed.append(steps[step])
    return removed
