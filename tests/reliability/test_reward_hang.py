"""A reward function that never returns: with reward_model.score_timeout_s the run ends in one line naming
the sample (the default on_score_error=raise), or validates and trains on with those samples scored 0
(on_score_error=zero); never a run that hangs forever."""

import json
import time

import pytest

pytestmark = pytest.mark.slow  # make test-slow: main_ppo with a hanging scorer, in its own process

HANGING_REWARD = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(3600)  # a verifier stuck forever
"""


def test_a_hanging_reward_function_is_one_line_naming_the_sample(main_ppo, tmp_path):
    scorer = tmp_path / "hanging_reward.py"
    scorer.write_text(HANGING_REWARD)
    run = main_ppo(
        custom_reward_function__path=scorer,
        reward_model__score_timeout_s=1,
        trainer__total_training_steps=2,
        trainer__save_on_preempt=False,
    )
    started = time.monotonic()
    assert run.wait(120) == 1, run.tail()
    assert time.monotonic() - started < 90
    errors = [line for line in run.output().splitlines() if line.startswith("hybridflow: error:")]
    assert len(errors) == 1 and "Traceback" not in run.output(), run.tail()
    assert "reward scoring failed for data_source='hybridflow/arithmetic', sample 0:" in errors[0]
    assert "scorer timed out after reward_model.score_timeout_s=1s" in errors[0]
    assert "response[:200]=" in errors[0] and "on_score_error=zero" in errors[0]
    assert run.steps_logged() == []
    run.assert_no_survivors(within_s=5)


def test_with_on_score_error_zero_training_goes_on(main_ppo, tmp_path):
    scorer = tmp_path / "hanging_reward.py"
    scorer.write_text(HANGING_REWARD)
    run = main_ppo(
        custom_reward_function__path=scorer,
        reward_model__on_score_error="zero",
        reward_model__score_timeout_s=0.5,
        reward_model__batch_timeout_s=1,  # the rest of the batch is not even tried
        trainer__total_training_steps=2,
        trainer__val_before_train=True,  # validation scores through the same limits
        trainer__save_on_preempt=False,
    )
    assert run.wait(150) == 0, run.tail()
    records = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["val-core/hybridflow/arithmetic/reward/mean@1"] == 0.0
    assert all(r["critic/score/mean"] == 0.0 for r in records[1:])
    assert all(r["timing_s/reward"] < 5 for r in records[1:])
