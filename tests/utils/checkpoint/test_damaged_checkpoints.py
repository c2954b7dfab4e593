"""Damaged checkpoints (issue 32): every step carries a manifest of its files' sizes and hashes, written
after all workers returned; a resume checks it (loading nothing), names the damaged step, file and
problem, falls back to the newest complete step in one line (``resume_mode=auto``) or refuses
(``resume_path``, or no complete step left); steps without a tracker are scanned; steps saved before
manifests are checked for what can be checked; pruning never lets a damaged step push out a complete one.

The steps here are real: ``TrainerCheckpointer.save`` drives two "worker groups" (actor and critic, each
an ``FSDPCheckpointManager`` on the toy model in a 1-rank gloo group) the way the trainer's driver does.
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.ppo.checkpointing import TrainerCheckpointer
from hybridflow.utils.checkpoint import FSDPCheckpointManager
from hybridflow.utils.checkpoint.manifest import (
    MANIFEST_FILE,
    CheckpointDamagedError,
    check_step,
    read_manifest,
)
from hybridflow.utils.checkpoint.tracker import (
    TRACKER_FILE,
    find_resumable_checkpoint,
    list_step_dirs,
    prune_checkpoints,
    read_latest_checkpointed_iteration,
)
from tests.utils.checkpoint import fsdp_toy

SHARD = "actor/model/__0_0.distcp"


class _Group:
    """The driver's handle on a worker group: ``save_checkpoint`` returns once every rank has written.
    Records, at each call, what the step's manifest said then."""

    def __init__(self, manager: FSDPCheckpointManager, seen: list) -> None:
        self.manager, self.seen = manager, seen

    def save_checkpoint(self, path: str, step: int, keep) -> None:
        manifest = read_manifest(os.path.dirname(path))
        self.seen.append((os.path.basename(path), None if manifest is None else manifest["complete"]))
        self.manager.save_checkpoint(path, step)


@pytest.fixture(scope="module")
def trainer():
    """A stand-in for the trainer as ``TrainerCheckpointer`` sees it, with real actor and critic saves."""
    with fsdp_toy.gloo_group():
        seen: list = []
        actor, critic = fsdp_toy.build(1)[:2], fsdp_toy.build(1, seed=3)[:2]
        yield SimpleNamespace(
            global_steps=0,
            wg=SimpleNamespace(
                actor_rollout=_Group(FSDPCheckpointManager(*actor), seen),
                critic=_Group(FSDPCheckpointManager(*critic), seen),
            ),
            train_dataloader=SimpleNamespace(state_dict=lambda: {"position": 7}),
            kl_ctrl=SimpleNamespace(value=0.001),
            log_prob_parity=SimpleNamespace(verified=False, checked_at=0),
            seen=seen,
        )


@pytest.fixture(scope="module")
def saved(trainer, tmp_path_factory):
    """Steps 1 and 2 saved by the trainer's save path (tracker on 2), copied afresh for each test."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    checkpointer = _checkpointer(root)
    trainer.seen.clear()
    for step in (1, 2):
        trainer.global_steps = step
        checkpointer.save(trainer)
    trainer.seen_at_save = list(trainer.seen)
    return root


@pytest.fixture
def root(saved, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    return copy


def _checkpointer(root, **cfg) -> TrainerCheckpointer:
    return TrainerCheckpointer(OmegaConf.create({"default_local_dir": str(root), **cfg}))


def _truncate(path, keep: int = 100) -> int:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(keep)
    return size


def _resume_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("hybridflow:")]


def test_the_manifest_is_written_after_every_worker_and_lists_every_file(trainer, saved):
    # each worker group was called while step N's manifest still said "incomplete"
    assert trainer.seen_at_save == [("actor", False), ("critic", False)] * 2
    for step in (1, 2):
        step_dir = saved / f"global_step_{step}"
        manifest = read_manifest(str(step_dir))
        assert manifest["complete"] and manifest["step"] == step
        on_disk = sorted(
            str(p.relative_to(step_dir))
            for p in step_dir.rglob("*")
            if p.is_file() and p.name != MANIFEST_FILE
        )
        assert sorted(manifest["files"]) == on_disk
        assert {"data.pt", SHARD, "critic/model/.metadata", "actor/extra_state_rank_0.pt"} <= set(on_disk)
        for rel, entry in manifest["files"].items():
            assert entry["size"] == (step_dir / rel).stat().st_size and len(entry["sha256"]) == 64
    assert read_latest_checkpointed_iteration(str(saved)) == 2
    assert check_step(str(saved / "global_step_2"), ("actor", "critic"), 2).complete


def test_a_complete_latest_step_resumes_without_a_word(root, capsys):
    assert _checkpointer(root).resume_path(("actor", "critic")) == str(root / "global_step_2")
    assert _resume_lines(capsys) == []


def _damage_shard(step_dir):
    size = _truncate(step_dir / SHARD)
    return f"{SHARD}: 100 bytes, the manifest says {size} (truncated)"


def _damage_data_pt(step_dir):
    path = step_dir / "data.pt"
    path.write_bytes(b"\0" * path.stat().st_size)  # same size, other bytes
    return "data.pt: its content differs from the manifest's sha256 (the file was changed)"


def _lose_metadata(step_dir):
    os.remove(step_dir / "critic" / "model" / ".metadata")
    return "critic/model/.metadata: missing"


def _garble_manifest(step_dir):
    (step_dir / MANIFEST_FILE).write_text("{not json")
    return f"{MANIFEST_FILE}: unreadable (JSONDecodeError"


def _interrupt_resave(step_dir):
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    (step_dir / MANIFEST_FILE).write_text(json.dumps({**manifest, "complete": False}))
    return f"{MANIFEST_FILE}: marked incomplete: the save of this step did not finish"


def _remove_step(step_dir):
    shutil.rmtree(step_dir)
    return "the directory does not exist"


DAMAGES = [_damage_shard, _damage_data_pt, _lose_metadata, _garble_manifest, _interrupt_resave, _remove_step]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.strip("_"))
def test_auto_falls_back_to_the_previous_step_in_one_line(root, capsys, damage):
    what = damage(root / "global_step_2")
    path = _checkpointer(root).resume_path(("actor", "critic"))
    assert path == str(root / "global_step_1")
    lines = _resume_lines(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"hybridflow: checkpoint step 2 is damaged (step 2 ({root / 'global_step_2'}): "
    )
    assert what in lines[0]
    assert lines[0].endswith(f"; resuming from step 1 ({root / 'global_step_1'}) instead")
    assert _checkpointer(root).latest() == str(root / "global_step_1")


def test_several_damaged_steps_are_named_in_the_same_line(root, capsys):
    shutil.copytree(root / "global_step_2", root / "global_step_3")
    (root / TRACKER_FILE).write_text("3")
    _damage_data_pt(root / "global_step_3")
    _damage_shard(root / "global_step_2")
    assert _checkpointer(root).resume_path(("actor",)) == str(root / "global_step_1")
    (line,) = _resume_lines(capsys)
    assert line.startswith("hybridflow: checkpoint steps 3, 2 are damaged (step 3 (")
    assert "data.pt: its content differs" in line and f"{SHARD}: 100 bytes" in line


def test_no_complete_step_left_is_an_error_naming_the_damage(trainer, tmp_path):
    root = tmp_path / "ckpt"
    checkpointer = _checkpointer(root, max_actor_ckpt_to_keep=1, max_critic_ckpt_to_keep=1)
    for step in (1, 2):
        trainer.global_steps = step
        checkpointer.save(trainer)
    assert sorted(list_step_dirs(str(root))) == [2]  # max_*_ckpt_to_keep=1 removed step 1
    size = _truncate(root / "global_step_2" / SHARD)
    with pytest.raises(CheckpointDamagedError) as err:
        checkpointer.resume_path(("actor", "critic"))
    message = str(err.value)
    assert "\n" not in message
    assert f"no complete checkpoint to resume from in {root}: step 2 ({root / 'global_step_2'}): " in message
    assert f"{SHARD}: 100 bytes, the manifest says {size} (truncated)" in message
    assert "trainer.resume_mode=disable" in message
    assert checkpointer.latest() is None


def test_resume_path_at_a_damaged_step_is_an_error(root):
    size = _truncate(root / "global_step_1" / "data.pt", keep=10)
    checkpointer = _checkpointer(
        root, resume_mode="resume_path", resume_from_path=str(root / "global_step_1")
    )
    with pytest.raises(CheckpointDamagedError, match="resume_from_path") as err:
        checkpointer.resume_path(("actor", "critic"))
    assert (
        f"step 1 ({root / 'global_step_1'}): data.pt: 10 bytes, the manifest says {size} (truncated)"
        in str(err.value)
    )
    good = _checkpointer(root, resume_mode="resume_path", resume_from_path=str(root / "global_step_2"))
    assert good.resume_path(("actor", "critic")) == str(root / "global_step_2")


def test_without_a_tracker_the_step_directories_are_scanned(root, capsys):
    os.remove(root / TRACKER_FILE)
    assert _checkpointer(root).resume_path(("actor",)) == str(root / "global_step_2")
    assert _resume_lines(capsys) == [
        f"hybridflow: no {root / TRACKER_FILE}; found step directories 1, 2; resuming from step 2 "
        f"({root / 'global_step_2'})"
    ]
    size = _truncate(root / "global_step_2" / SHARD)
    assert _checkpointer(root).resume_path(("actor",)) == str(root / "global_step_1")
    (line,) = _resume_lines(capsys)
    assert f"no {root / TRACKER_FILE}; found step directories 1, 2; checkpoint step 2 is damaged" in line
    assert f"{SHARD}: 100 bytes, the manifest says {size} (truncated)" in line
    assert line.endswith(f"resuming from step 1 ({root / 'global_step_1'}) instead")


def test_an_unreadable_tracker_is_scanned_past(root, capsys):
    (root / TRACKER_FILE).write_text("two")
    choice = find_resumable_checkpoint(str(root), ("actor",))
    assert choice.step == 2 and "is unreadable" in choice.note and "'two'" in choice.note


def test_steps_newer_than_the_tracker_are_never_taken(root):
    shutil.copytree(root / "global_step_2", root / "global_step_3")  # complete, but the tracker says 2
    _truncate(root / "global_step_2" / SHARD)
    assert find_resumable_checkpoint(str(root), ("actor",)).step == 1


def test_a_pruned_critic_is_named_when_the_resume_needs_it(trainer, tmp_path):
    root = tmp_path / "ckpt"
    checkpointer = _checkpointer(root, max_critic_ckpt_to_keep=1)
    for step in (1, 2):
        trainer.global_steps = step
        checkpointer.save(trainer)
    assert not (root / "global_step_1" / "critic").exists()
    assert read_manifest(str(root / "global_step_1"))["pruned"] == ["critic"]
    assert check_step(str(root / "global_step_1"), ("actor",), 1).complete  # an actor-only resume could
    _truncate(root / "global_step_2" / SHARD)
    with pytest.raises(CheckpointDamagedError, match="critic: removed by trainer.max_critic_ckpt_to_keep"):
        checkpointer.resume_path(("actor", "critic"))


# --------------------------------------------------------------------- checkpoints saved before manifests
def test_a_legacy_step_is_trusted_after_the_checks_it_allows_and_says_so(root, capsys):
    for step in (1, 2):
        os.remove(root / f"global_step_{step}" / MANIFEST_FILE)
    assert _checkpointer(root).resume_path(("actor", "critic")) == str(root / "global_step_2")
    assert _resume_lines(capsys) == [
        f"hybridflow: checkpoint step 2 ({root / 'global_step_2'}) has no {MANIFEST_FILE} (saved before "
        "hybridflow wrote one): checked only that its parts exist, its DCP shards are as long as their "
        f"metadata says and its .pt files are whole; resuming from step 2 ({root / 'global_step_2'})"
    ]


@pytest.mark.parametrize(
    "part, expected",
    [
        (SHARD, f"{SHARD}: 100 bytes, its DCP metadata needs "),
        ("critic/optim/.metadata", "critic/optim/.metadata: unreadable ("),
        ("data.pt", "data.pt: not a whole torch.save file (BadZipFile"),
        ("actor/extra_state_rank_0.pt", "actor/extra_state_rank_0.pt: not a whole torch.save file"),
        ("critic/checkpoint_meta.json", "critic/checkpoint_meta.json: unreadable (JSONDecodeError"),
    ],
)
def test_a_damaged_legacy_step_is_named_and_skipped(root, capsys, part, expected):
    for step in (1, 2):
        os.remove(root / f"global_step_{step}" / MANIFEST_FILE)
    _truncate(
        root / "global_step_2" / part, keep=min(100, os.path.getsize(root / "global_step_2" / part) // 2)
    )
    assert _checkpointer(root).resume_path(("actor", "critic")) == str(root / "global_step_1")
    (line,) = _resume_lines(capsys)
    assert "checkpoint step 2 is damaged" in line and expected in line, line
    assert "step 1" in line and "has no checkpoint_manifest.json" in line


def test_a_legacy_step_missing_a_role_the_resume_needs(root):
    os.remove(root / "global_step_2" / MANIFEST_FILE)
    shutil.rmtree(root / "global_step_2" / "critic")
    check = check_step(str(root / "global_step_2"), ("actor", "critic"), 2)
    assert [str(d) for d in check.damage] == ["critic: missing"]


# --------------------------------------------------------------------- pruning
def test_pruning_never_lets_a_damaged_step_push_out_a_complete_one(trainer, root):
    """Steps 1 and 2 complete, step 4 damaged (a resume fell back past it); saving step 3 with a limit
    of 2 keeps 3 and 2: step 4 does not count, and is left for the run to overwrite."""
    shutil.copytree(root / "global_step_2", root / "global_step_4")
    _truncate(root / "global_step_4" / SHARD)
    trainer.global_steps = 3
    _checkpointer(root, max_actor_ckpt_to_keep=2, max_critic_ckpt_to_keep=2).save(trainer)
    assert sorted(list_step_dirs(str(root))) == [2, 3, 4]
    assert check_step(str(root / "global_step_2"), ("actor", "critic"), 2).complete
    assert find_resumable_checkpoint(str(root), ("actor", "critic")).step == 3


def test_prune_checkpoints_skips_damaged_steps(root):
    for step in (3, 4):
        shutil.copytree(root / "global_step_2", root / f"global_step_{step}")
    _truncate(root / "global_step_4" / "data.pt", keep=10)
    removed = prune_checkpoints(str(root), keep=2, protect=3)
    assert sorted(os.path.basename(p) for p in removed) == ["global_step_1"]
    assert sorted(list_step_dirs(str(root))) == [2, 3, 4]


def test_the_entry_points_report_the_damage_in_one_line():
    """``main_ppo`` and ``fully_async_main`` print a ``CheckpointDamagedError`` as one line, exit 1."""
    from hybridflow.trainer.main_ppo import one_line_errors

    assert CheckpointDamagedError in one_line_errors()
