"""SIGTERM against a running ``fully_async_main``: the step in progress finishes, a checkpoint is saved,
the rollouter stops, the process exits 143 with nothing left running; a rerun resumes from that step and
trains each remaining step once."""

import os
import signal

import pytest

from hybridflow.utils.checkpoint.tracker import read_latest_checkpointed_iteration
from tests.reliability.conftest import EXPERIMENT, Run
from tests.tiny_run import tiny_run_values

pytestmark = pytest.mark.slow  # make test-slow: fully_async_main signalled in its own process, then rerun

def _start(tiny_model_dir, arithmetic_data, tmp_path) -> Run:
    values = tiny_run_values(
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "ckpt",
        **{
            "trainer.experiment_name": EXPERIMENT,
            "ray_init.num_cpus": 4,
            "trainer.n_gpus_per_node": 1,
            "rollout.n_gpus_per_node": 1,
            "trainer.total_training_steps": 5,
            "async_training.staleness_threshold": 1,
            "async_training.partial_rollout": True,
        },
    )
    return Run(tmp_path, values, module="hybridflow.trainer.fully_async_main")


def test_sigterm_saves_exits_143_and_a_rerun_resumes(tiny_model_dir, arithmetic_data, tmp_path):
    run = _start(tiny_model_dir, arithmetic_data, tmp_path)
    try:
        run.wait_until(lambda: len(run.steps_logged()) >= 1, 180, "first step")
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.wait(90) == 143, run.tail()
        stopped = read_latest_checkpointed_iteration(str(tmp_path / "ckpt"))
        assert stopped is not None and stopped == max(run.steps_logged()) < 5
        assert f"SIGTERM: stopped after step {stopped}" in run.output()
        run.assert_no_survivors(within_s=10)

        rerun = _start(tiny_model_dir, arithmetic_data, tmp_path)
        try:
            assert rerun.wait(240) == 0, rerun.tail()
            assert f"(step {stopped})" in rerun.output()
            assert rerun.steps_logged() == [1, 2, 3, 4, 5]  # each step once
        finally:
            rerun.kill_everything()
    finally:
        run.kill_everything()
