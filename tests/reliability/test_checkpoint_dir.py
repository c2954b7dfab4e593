"""A checkpoint directory that cannot take a checkpoint is one line before any step (a file in the way, a
read-only mount, a disk too small); a disk that fills up mid-run fails that save in one line, after the
step's metrics are logged, with its partial files removed and the previous checkpoint kept."""

import time

import pytest

from hybridflow.utils.checkpoint.tracker import read_latest_checkpointed_iteration

pytestmark = pytest.mark.slow  # make test-slow: a main_ppo process per test, against a broken disk


def _assert_fails_before_any_step(run, *expected: str) -> None:
    started = time.monotonic()
    assert run.wait(120) == 1, run.tail()
    assert time.monotonic() - started < 60  # no Ray, no workers: the check runs first
    errors = [line for line in run.output().splitlines() if line.startswith("hybridflow: error:")]
    assert len(errors) == 1, run.tail()
    for text in expected:
        assert text in errors[0], errors[0]
    assert "Traceback" not in run.output() and "Ray" not in run.output()
    assert run.steps_logged() == []


def test_a_file_where_the_directory_should_be(main_ppo, tmp_path):
    (tmp_path / "blocker").write_text("not a directory")
    run = main_ppo(trainer__default_local_dir=tmp_path / "blocker" / "ckpt", trainer__total_training_steps=1)
    _assert_fails_before_any_step(run, f"{tmp_path / 'blocker'} is a file, not a directory")


def test_a_read_only_mount(main_ppo, tmpfs):
    mount = tmpfs("1m", read_only=True)
    run = main_ppo(trainer__default_local_dir=mount / "ckpt", trainer__total_training_steps=1)
    _assert_fails_before_any_step(run, f"{mount / 'ckpt'}: cannot create the directory", "(EROFS)")


@pytest.mark.parametrize("save_freq", [-1, 2], ids=["preempt-save-only", "periodic"])
def test_a_disk_too_small_for_one_checkpoint(main_ppo, tmpfs, save_freq):
    mount = tmpfs("1m")
    run = main_ppo(
        trainer__default_local_dir=mount / "ckpt",
        trainer__total_training_steps=1,
        trainer__save_freq=save_freq,
    )
    _assert_fails_before_any_step(
        run, "1.0 MiB free, but one checkpoint needs about", "trainer.save_on_preempt=false"
    )


def test_a_disk_that_fills_up_mid_run(main_ppo, tmpfs):
    """3 MiB take one checkpoint of the tiny model (~1.8 MiB) but not a second one."""
    mount = tmpfs("3m")
    root = mount / "ckpt"
    run = main_ppo(trainer__default_local_dir=root, trainer__total_training_steps=4, trainer__save_freq=1)
    assert run.wait(180) == 1, run.tail()
    errors = [line for line in run.output().splitlines() if line.startswith("hybridflow: error:")]
    assert len(errors) == 1 and "Traceback" not in run.output(), run.tail()
    assert f"saving the checkpoint of step 2 to {root / 'global_step_2'} failed: " in errors[0]
    assert "No space left on device" in errors[0] or "MiB free there when it failed" in errors[0], errors[0]
    assert f"the checkpoint a resume finds is {root / 'global_step_1'}" in errors[0]
    assert run.steps_logged() == [1, 2]  # the failing step's metrics are logged
    assert read_latest_checkpointed_iteration(str(root)) == 1
    assert sorted(p.name for p in root.iterdir()) == ["global_step_1", "latest_checkpointed_iteration.txt"]
    run.assert_no_survivors(within_s=5)
