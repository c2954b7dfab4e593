"""Checks before spending: the checkpoint size estimate against what FSDPCheckpointManager really writes,
the directory probe, one-line root causes of failed saves, and the config checks of the new keys."""

import errno
import os

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import ConfigError, load_config, validate_config
from hybridflow.trainer.ppo.checkpointing import TrainerCheckpointer, estimate_checkpoint_bytes
from hybridflow.utils.checkpoint import FSDPCheckpointManager
from hybridflow.utils.checkpoint.preflight import CheckpointDirError, probe_checkpoint_dir, root_cause
from tests.utils.checkpoint import fsdp_toy


def _dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_the_estimate_covers_a_real_checkpoint_without_overshooting(tmp_path):
    """The toy model (tied embeddings: the state dict holds them twice) saved at world 1 with model,
    optimizer and extra state: the estimate is above the bytes on disk and within 1.5x."""
    model_dir = tmp_path / "model"
    fsdp_toy.tiny_config().save_pretrained(model_dir)
    config = load_config(
        [f"actor_rollout_ref.model.path={model_dir}", "trainer.n_gpus_per_node=1", "data.train_batch_size=8"]
    )
    OmegaConf.resolve(config)
    estimate = estimate_checkpoint_bytes(config)
    with fsdp_toy.gloo_group():
        model, optimizer, scheduler = fsdp_toy.build(1)
        fsdp_toy.train_steps(model, optimizer, scheduler, 1)  # AdamW state exists only after a step
        FSDPCheckpointManager(model, optimizer, scheduler).save_checkpoint(str(tmp_path / "actor"), 1)
    written = _dir_bytes(tmp_path / "actor")
    assert written < estimate < 1.5 * written, (written, estimate)


def test_the_probe_names_each_problem(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointDirError, match=r"file is a file, not a directory"):
        probe_checkpoint_dir(str(tmp_path / "file" / "ckpt"), None)
    free = probe_checkpoint_dir(str(tmp_path / "new" / "ckpt"), 1)  # created, written, measured
    assert (tmp_path / "new" / "ckpt").is_dir() and os.listdir(tmp_path / "new" / "ckpt") == []
    with pytest.raises(CheckpointDirError, match=r"MiB free, but one checkpoint needs about .*save_freq=-1"):
        probe_checkpoint_dir(str(tmp_path / "new" / "ckpt"), free * 2)


def test_a_run_that_never_saves_is_not_checked(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = {"default_local_dir": str(tmp_path / "file" / "ckpt"), "save_freq": -1, "save_on_preempt": False}
    checkpointer = TrainerCheckpointer(OmegaConf.create(cfg))
    assert not checkpointer.saves()
    checkpointer.preflight(config=None)  # nothing to check, nothing raised
    assert TrainerCheckpointer(OmegaConf.create({**cfg, "save_on_preempt": True})).saves()


def test_root_cause_finds_the_os_error_inside_wrappers():
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(
        errno.ENOSPC, "No space left on device", "/ckpt/global_step_2/actor.tmp/model/__0_0.distcp"
    )
    wrapped = CheckpointException("write", {0: (full, [])})
    try:
        raise RuntimeError("save_checkpoint failed on a worker") from wrapped
    except RuntimeError as err:
        line = root_cause(err)
    assert line == "No space left on device (ENOSPC): '/ckpt/global_step_2/actor.tmp/model/__0_0.distcp'"
    inner = CheckpointException(
        "write", {0: (RuntimeError("[enforce fail at inline_container.cc:672]\nmore"), [])}
    )
    assert root_cause(inner) == "RuntimeError: [enforce fail at inline_container.cc:672]"


@pytest.mark.parametrize(
    "override",
    [
        "reward_model.score_timeout_s=0",
        "reward_model.batch_timeout_s=-5",
        "reward_model.score_timeout_s=soon",
        "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=0",
        "trainer.save_on_preempt=maybe",
    ],
)
def test_failure_settings_are_validated(base_overrides, override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        validate_config(load_config([*base_overrides, override]))


def test_no_limit_is_null(base_overrides):
    nulls = ["reward_model.score_timeout_s=null", "reward_model.batch_timeout_s=null"]
    validate_config(
        load_config([*base_overrides, *nulls, "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=null"])
    )
