"""Trainer-level tracker: atomic writes, latest-step lookup and pruning of global_step_N directories."""

import os

import pytest
import torch

from hybridflow.utils.checkpoint.tracker import (
    TRACKER_FILE,
    atomic_torch_save,
    find_latest_ckpt_path,
    global_step_dir,
    list_step_dirs,
    prune_checkpoints,
    read_latest_checkpointed_iteration,
    write_latest_checkpointed_iteration,
)


def _make_steps(root, steps):
    for step in steps:
        os.makedirs(os.path.join(global_step_dir(str(root), step), "actor"))


def test_tracker_roundtrip_leaves_no_temp_files(tmp_path):
    root = str(tmp_path / "ckpts")
    assert read_latest_checkpointed_iteration(root) is None
    assert find_latest_ckpt_path(root) is None

    _make_steps(root, [3, 7])
    write_latest_checkpointed_iteration(root, 3)
    write_latest_checkpointed_iteration(root, 7)
    assert read_latest_checkpointed_iteration(root) == 7
    assert find_latest_ckpt_path(root) == os.path.join(root, "global_step_7")
    assert sorted(os.listdir(root)) == ["global_step_3", "global_step_7", TRACKER_FILE]


def test_tracker_pointing_to_missing_dir_or_garbage_raises(tmp_path):
    write_latest_checkpointed_iteration(str(tmp_path), 5)
    with pytest.raises(FileNotFoundError, match="global_step_5"):
        find_latest_ckpt_path(str(tmp_path))
    (tmp_path / TRACKER_FILE).write_text("five")
    with pytest.raises(ValueError, match="five"):
        read_latest_checkpointed_iteration(str(tmp_path))


def test_prune_keeps_newest_and_protected(tmp_path):
    root = str(tmp_path)
    _make_steps(root, [1, 2, 3, 4, 5])
    (tmp_path / "global_step_x").mkdir()  # not a step directory: never touched

    removed = prune_checkpoints(root, keep=2, protect=5)
    assert sorted(os.path.basename(p) for p in removed) == ["global_step_1", "global_step_2", "global_step_3"]
    assert sorted(list_step_dirs(root)) == [4, 5]
    assert (tmp_path / "global_step_x").is_dir()

    # Steps newer than the protected one (left by an abandoned run) cannot push it out.
    _make_steps(root, [8, 9])
    prune_checkpoints(root, keep=1, protect=5)
    assert sorted(list_step_dirs(root)) == [5, 9]
    assert prune_checkpoints(root, keep=None, protect=5) == []
    assert sorted(list_step_dirs(root)) == [5, 9]


def test_atomic_torch_save_roundtrip_and_failure_keeps_old_file(tmp_path):
    path = str(tmp_path / "data.pt")
    atomic_torch_save({"epoch": 1, "x": torch.arange(3)}, path)
    loaded = torch.load(path)
    assert loaded["epoch"] == 1 and torch.equal(loaded["x"], torch.arange(3))

    with pytest.raises(Exception):  # noqa: B017 - pickling a lambda fails inside torch.save
        atomic_torch_save({"epoch": 2, "fn": lambda: 0}, path)
    assert torch.load(path)["epoch"] == 1
    assert os.listdir(tmp_path) == ["data.pt"]
