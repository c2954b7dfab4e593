"""Time limits on reward functions: every manager stops a hanging scorer, names the sample (or scores it 0
with on_score_error=zero), and prime runs custom reward files in its worker processes."""

import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hybridflow.workers.reward_manager import (
    BatchRewardManager,
    CustomRewardFunction,
    DAPORewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
    RewardScoreError,
    build_reward_manager,
)
from hybridflow.workers.reward_manager.naive import DEFAULT_BATCH_TIMEOUT_S, DEFAULT_SCORE_TIMEOUT_S
from hybridflow.workers.reward_manager.timeouts import EXIT_SCORER_HUNG, TIMEOUT_SIGNAL
from tests.workers.reward_manager.test_reward_managers import SOURCE, make_batch


@pytest.fixture(scope="module")
def tokenizer():
    from hybridflow.models.tiny import build_tokenizer
    from hybridflow.tasks.arithmetic import task_texts

    return build_tokenizer(task_texts(n=300))


def sleep_on_nine(data_source, solution_str, ground_truth, extra_info=None):
    if "9" in solution_str:
        time.sleep(60)
    return 1.0


def spin_on_nine(data_source, solution_str, ground_truth, extra_info=None):
    """A pure-Python busy loop that also swallows ordinary exceptions."""
    while "9" in solution_str:
        try:
            sum(range(1000))
        except Exception:
            pass
    return 1.0


def uses_its_own_alarm(data_source, solution_str, ground_truth, extra_info=None):
    """Math graders limit themselves with SIGALRM; that must keep working under the manager's limit."""

    class OwnTimeout(Exception):
        pass

    def handler(signum, frame):
        raise OwnTimeout

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    try:
        time.sleep(5)
        return 1.0
    except OwnTimeout:
        return 0.5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def hang_batch(data_sources, solution_strs, ground_truths, extra_infos):
    time.sleep(60)


def slow_sample(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.6)
    return 1.0


@pytest.mark.parametrize("scorer", [sleep_on_nine, spin_on_nine], ids=["sleep", "busy-loop"])
@pytest.mark.parametrize("manager_cls", [NaiveRewardManager, DAPORewardManager], ids=["naive", "dapo"])
def test_a_hanging_scorer_is_an_error_naming_the_sample(tokenizer, scorer, manager_cls):
    data = make_batch(tokenizer, ["12", "19", "3"], ["12", "19", "3"])
    manager = manager_cls(tokenizer, 0, compute_score=scorer, score_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RewardScoreError) as info:
        manager(data)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert f"data_source={SOURCE!r}, sample 1:" in message
    assert "score_timeout_s=0.5s" in message and "response[:200]='19'" in message
    assert "on_score_error=zero" in message


def test_raise_mode_stops_scoring_at_the_first_failed_sample(tokenizer):
    called = []

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        called.append(solution_str)
        return sleep_on_nine(data_source, solution_str, ground_truth)

    data = make_batch(tokenizer, ["12", "19", "3", "4"], ["12", "19", "3", "4"])
    with pytest.raises(RewardScoreError, match="sample 1:"):
        NaiveRewardManager(tokenizer, 0, compute_score=scorer, score_timeout_s=0.5)(data)
    assert called == ["12", "19"]  # 3 and 4 would only delay the error


def test_on_score_error_zero_scores_a_timeout_zero_and_marks_it(tokenizer):
    data = make_batch(tokenizer, ["12", "19", "3"], ["12", "19", "3"])
    manager = NaiveRewardManager(
        tokenizer, 0, compute_score=sleep_on_nine, score_timeout_s=0.5, on_score_error="zero"
    )
    out = manager(data, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0, 1.0]
    assert out["reward_extra_info"]["timed_out"] == [0, 1, 0]
    assert out["reward_extra_info"]["score_error"] == [0, 1, 0]


def test_a_scorers_own_sigalrm_is_left_alone(tokenizer):
    data = make_batch(tokenizer, ["1"], ["1"])
    manager = NaiveRewardManager(tokenizer, 0, compute_score=uses_its_own_alarm, score_timeout_s=3.0)
    assert manager(data).sum().item() == 0.5


def test_the_batch_deadline_stops_the_rest_of_the_batch(tokenizer):
    data = make_batch(tokenizer, ["1", "2", "3", "4"], ["1", "2", "3", "4"])
    manager = NaiveRewardManager(
        tokenizer,
        0,
        compute_score=slow_sample,
        score_timeout_s=10,
        batch_timeout_s=1.0,
        on_score_error="zero",
    )
    start = time.monotonic()
    out = manager(data, return_dict=True)
    assert time.monotonic() - start < 2.5  # not 4 x 0.6 s
    assert out["reward_extra_info"]["timed_out"] == [0, 1, 1, 1]
    with pytest.raises(RewardScoreError, match=r"sample 1: the batch's scoring ran past .*=1s"):
        NaiveRewardManager(tokenizer, 0, compute_score=slow_sample, batch_timeout_s=1.0)(data)


def test_the_batch_managers_one_call_is_limited(tokenizer):
    data = make_batch(tokenizer, ["1", "2"], ["1", "2"])
    with pytest.raises(RewardScoreError, match=r"sample 0: the batch's scoring ran past .*=0.5s"):
        BatchRewardManager(tokenizer, 0, compute_score=hang_batch, batch_timeout_s=0.5)(data)
    zero = BatchRewardManager(
        tokenizer, 0, compute_score=hang_batch, batch_timeout_s=0.5, on_score_error="zero"
    )
    out = zero(data, return_dict=True)
    assert out["reward_tensor"].sum().item() == 0.0 and out["reward_extra_info"]["timed_out"] == [1, 1]


def test_off_the_main_thread_the_caller_stops_waiting(tokenizer):
    data = make_batch(tokenizer, ["19"], ["19"])
    manager = NaiveRewardManager(tokenizer, 0, compute_score=sleep_on_nine, score_timeout_s=0.5)
    errors = []

    def score():
        try:
            manager(data)
        except RewardScoreError as err:
            errors.append(err)

    thread = threading.Thread(target=score)
    start = time.monotonic()
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert len(errors) == 1 and "sample 0" in str(errors[0])


def test_a_scorer_stuck_in_native_code_ends_the_process_naming_the_sample():
    """Blocking the timeout signal stands in for a C extension that never returns to Python."""
    script = textwrap.dedent(
        f"""
        import signal, time
        from hybridflow.workers.reward_manager import timeouts
        timeouts.NATIVE_HANG_GRACE_S = 1.0
        def stuck():
            signal.pthread_sigmask(signal.SIG_BLOCK, {{{int(TIMEOUT_SIGNAL)}}})
            time.sleep(60)
        timeouts.call_with_time_limit(stuck, 0.5, "scorer timed out after 0.5s",
                                      describe=lambda: "data_source='src', sample 3")
        """
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_SCORER_HUNG, proc.stderr
    assert time.monotonic() - start < 30
    assert "stuck in native code" in proc.stderr and "data_source='src', sample 3" in proc.stderr
    assert "reward_manager=prime" in proc.stderr


HANGING_FILE = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if "9" in solution_str:
        time.sleep(60)
    return 1.0 + bonus
"""


def test_prime_runs_a_custom_reward_file_built_twice(tmp_path, tokenizer):
    """main_ppo builds the training and the validation manager from the same file; both must pickle
    their scorer to the workers (a re-import made the first one "not the same object")."""
    path = tmp_path / "hang_reward.py"
    path.write_text(HANGING_FILE)
    custom = {"path": str(path), "reward_kwargs": {"bonus": 0.5}}
    cfg = {
        "reward_manager": "prime",
        "reward_kwargs": {"num_processes": 2},
        "score_timeout_s": 1.0,
        "on_score_error": "zero",
    }
    train = build_reward_manager(cfg, custom, tokenizer, 0)
    val = build_reward_manager(cfg, custom, tokenizer, 0)
    data = make_batch(tokenizer, ["1", "19"], ["1", "19"])
    for manager in (train, val):
        out = manager(data, return_dict=True)
        assert out["reward_tensor"].sum(-1).tolist() == [1.5, 0.0]
        assert out["reward_extra_info"]["timed_out"] == [0, 1]
    with pytest.raises(RewardScoreError, match=r"sample 1: scorer timed out after .*score_timeout_s=1s"):
        build_reward_manager({**cfg, "on_score_error": "raise"}, custom, tokenizer, 0)(data)


def test_prime_workers_started_fresh_import_the_reward_file_themselves(tmp_path, tokenizer):
    path = tmp_path / "spawned_reward.py"
    path.write_text(HANGING_FILE)
    cfg = {"reward_manager": "prime", "reward_kwargs": {"num_processes": 1, "mp_context": "spawn"}}
    manager = build_reward_manager(cfg, {"path": str(path)}, tokenizer, 0)
    assert manager(make_batch(tokenizer, ["1"], ["1"])).sum().item() == 1.0


def test_a_custom_reward_function_pickles_as_its_path(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(HANGING_FILE)
    fn = CustomRewardFunction(path, "compute_score", {"bonus": 2.0})
    clone = pickle.loads(pickle.dumps(fn))
    assert clone(data_source="s", solution_str="1", ground_truth="1") == 3.0
    assert len(pickle.dumps(fn)) < 500  # the path, not the module
    with pytest.raises(AttributeError, match="no function 'nope'"):
        CustomRewardFunction(path, "nope")


def test_timeouts_come_from_the_config_with_the_yaml_defaults(tokenizer):
    from omegaconf import OmegaConf

    yaml = OmegaConf.load(Path(__file__).parents[3] / "hybridflow/trainer/config/ppo_trainer.yaml")
    assert yaml.reward_model.score_timeout_s == DEFAULT_SCORE_TIMEOUT_S
    assert yaml.reward_model.batch_timeout_s == DEFAULT_BATCH_TIMEOUT_S
    manager = build_reward_manager(yaml.reward_model, None, tokenizer, 0)
    assert manager.score_timeout_s == DEFAULT_SCORE_TIMEOUT_S
    assert manager.batch_timeout_s == DEFAULT_BATCH_TIMEOUT_S
    unlimited = build_reward_manager({"score_timeout_s": None, "batch_timeout_s": None}, None, tokenizer, 0)
    assert (unlimited.score_timeout_s, unlimited.batch_timeout_s) == (None, None)
    with pytest.raises(ValueError, match="score_timeout_s must be a positive number"):
        build_reward_manager({"score_timeout_s": 0}, None, tokenizer, 0)
    with pytest.raises(ValueError, match="batch_timeout_s must be a positive number"):
        PrimeRewardManager(tokenizer, 0, batch_timeout_s=-1)
