"""Signals and kills against a running main_ppo: SIGTERM stops after the step with a checkpoint and exit
code 143, and a rerun resumes with each step logged once; kill -9 of the driver in the middle of a save
leaves a loadable previous checkpoint and no Ray helper behind; kill -9 of a worker in the middle of a save
ends the run naming it, with the save's partial files removed."""

import os
import signal
import time

import pytest

from hybridflow.utils.checkpoint.tracker import find_latest_ckpt_path, read_latest_checkpointed_iteration

pytestmark = pytest.mark.slow  # make test-slow: main_ppo signalled or killed in its own process, then rerun

def test_sigterm_saves_the_step_exits_143_and_a_rerun_resumes(main_ppo, tmp_path):
    run = main_ppo(trainer__total_training_steps=5)
    run.wait_until(lambda: len(run.steps_logged()) >= 1, 120, "first step")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(60) == 143, run.tail()
    stopped = read_latest_checkpointed_iteration(str(tmp_path / "ckpt"))
    assert stopped is not None and stopped == max(run.steps_logged()) < 5
    assert f"SIGTERM: stopped after step {stopped}; the checkpoint a resume finds is" in run.output()
    run.assert_no_survivors(within_s=5)

    rerun = main_ppo(trainer__total_training_steps=5)
    assert rerun.wait(180) == 0, rerun.tail()
    assert f"resumed from {tmp_path / 'ckpt'}/global_step_{stopped} (step {stopped})" in rerun.output()
    assert rerun.steps_logged() == [1, 2, 3, 4, 5]  # each step once: nothing replayed twice
    rerun.assert_no_survivors(within_s=5)


def test_kill_9_of_the_driver_mid_save_keeps_the_previous_checkpoint(main_ppo, tmp_path):
    root = tmp_path / "ckpt"
    run = main_ppo(trainer__total_training_steps=4, trainer__save_freq=1)
    run.wait_until(lambda: (root / "global_step_2" / "actor.tmp").exists(), 120, "the save of step 2", 0.002)
    os.kill(run.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    run.wait(10)
    # Ray's helpers (GCS, raylet, dashboard and runtime-env agents, workers) go with the driver
    run.assert_no_survivors(within_s=5)
    assert time.monotonic() - killed_at < 10
    latest = read_latest_checkpointed_iteration(str(root))
    assert latest in (1, 2)  # 2 only if the save had finished when the kill landed
    assert (root / f"global_step_{latest}" / "actor" / "checkpoint_meta.json").exists()

    rerun = main_ppo(trainer__total_training_steps=4, trainer__save_freq=1)
    assert rerun.wait(180) == 0, rerun.tail()
    assert f"(step {latest})" in rerun.output()
    assert rerun.steps_logged() == [1, 2, 3, 4]
    assert find_latest_ckpt_path(str(root)) == str(root / "global_step_4")
    assert not any(p.name.endswith(".tmp") for p in root.rglob("*"))  # the killed save's leftovers


def test_kill_9_of_a_worker_mid_save_ends_the_run_naming_it(main_ppo, tmp_path):
    root = tmp_path / "ckpt"
    run = main_ppo(trainer__total_training_steps=4, trainer__save_freq=1, trainer__n_gpus_per_node=2)
    run.wait_until(lambda: (root / "global_step_2" / "actor.tmp").exists(), 120, "the save of step 2", 0.002)
    workers = [pid for pid in run.record_descendants() if _cmdline(pid).startswith("ray::Colocated")]
    assert len(workers) == 2, [(pid, _cmdline(pid)) for pid in run.seen]
    os.kill(workers[1], signal.SIGKILL)
    killed_at = time.monotonic()
    assert run.wait(30) == 1, run.tail()
    assert time.monotonic() - killed_at < 20
    assert "rank 1" in run.output() and "died during" in run.output()
    if read_latest_checkpointed_iteration(str(root)) == 1:  # the kill landed in the save (the usual case)
        errors = [line for line in run.output().splitlines() if line.startswith("hybridflow: error:")]
        assert len(errors) == 1 and "saving the checkpoint of step 2" in errors[0], run.tail()
        assert f"the checkpoint a resume finds is {root / 'global_step_1'}" in errors[0]
        assert not (root / "global_step_2").exists()
    else:  # the save had finished: the next step's call found the worker dead
        assert read_latest_checkpointed_iteration(str(root)) == 2
    run.assert_no_survivors(within_s=5)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
