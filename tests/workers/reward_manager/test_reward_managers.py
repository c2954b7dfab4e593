"""Reward managers: score placement, batch/dapo/prime behaviour, custom functions, bad-score handling."""

import math
import signal
import time

import pytest
import torch

from hybridflow.models.tiny import build_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.tasks.arithmetic import task_texts
from hybridflow.workers.reward_manager import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
    RewardScoreError,
    build_reward_manager,
    get_reward_manager_cls,
    load_custom_reward_function,
)
from hybridflow.workers.reward_manager import prime as prime_module
from hybridflow.workers.reward_manager.timeouts import TIMEOUT_SIGNAL

SOURCE = "hybridflow/arithmetic"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(task_texts(n=300))


def make_batch(tokenizer, responses, truths, t_p=24, t_r=8, data_source=SOURCE) -> DataProto:
    """Left-padded prompts ``(B, t_p)``, right-padded responses ``(B, t_r)``, verl's non-tensor fields."""
    pad = tokenizer.pad_token_id
    prompts, resp, mask = [], [], []
    for i, response in enumerate(responses):
        p = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {i} + 1?"}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"]
        prompts.append([pad] * (t_p - len(p)) + p)
        resp.append(r + [pad] * (t_r - len(r)))
        mask.append([0] * (t_p - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (t_r - len(r)))
    n = len(responses)
    return DataProto.from_dict(
        tensors={
            "prompts": torch.tensor(prompts),
            "responses": torch.tensor(resp),
            "attention_mask": torch.tensor(mask),
        },
        non_tensors={
            "data_source": [data_source] * n,
            "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
            "extra_info": [{"index": i} for i in range(n)],
        },
    )


def constant_one(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def raise_on_seven(data_source, solution_str, ground_truth, extra_info=None):
    if "7" in solution_str:
        raise RuntimeError("verifier crashed")
    return 1.0


def nan_on_seven(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan") if "7" in solution_str else 1.0


def sleep_on_nine(data_source, solution_str, ground_truth, extra_info=None):
    """Module level so it pickles to prime's worker processes; '9' hangs far past the timeout."""
    if "9" in solution_str:
        time.sleep(60)
    return {"score": float(solution_str == ground_truth), "pid_marker": 1}


# ------------------------------------------------------------------------------------------- naive
def test_score_sits_on_the_last_valid_response_token(tokenizer):
    data = make_batch(tokenizer, ["132", "4", "5<|im_end|>"], ["132", "5", "5"])
    reward = NaiveRewardManager(tokenizer, num_examine=0)(data)
    assert reward.dtype == torch.float32 and reward.shape == (3, 8)
    expected = torch.zeros(3, 8)
    expected[0, 2] = 1.0  # "1","3","2": last valid token index 2
    expected[2, 1] = 1.0  # "5" then <|im_end|> (valid, decoded away): index 1
    assert torch.equal(reward, expected)


def test_return_dict_collects_extra_fields(tokenizer):
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "acc": solution_str == ground_truth, "idx": extra_info["index"]}

    out = NaiveRewardManager(tokenizer, 0, compute_score=scorer)(
        make_batch(tokenizer, ["1", "22"], ["1", "2"]), True
    )
    assert out["reward_tensor"][0, 0] == 0.5 and out["reward_tensor"][1, 1] == 0.5
    assert out["reward_extra_info"] == {"acc": [True, False], "idx": [0, 1]}


def test_reward_kwargs_reach_the_scorer(tokenizer):
    data = make_batch(tokenizer, ["72"], ["72"], data_source="openai/gsm8k")
    assert NaiveRewardManager(tokenizer, 0)(data).sum() == 0.0  # strict gsm8k wants "#### 72"
    assert NaiveRewardManager(tokenizer, 0, method="flexible")(data).sum() == 1.0


def test_rm_scores_are_returned_as_they_are(tokenizer):
    data = make_batch(tokenizer, ["1"], ["1"])
    data.batch["rm_scores"] = torch.full((1, 8), 0.25)
    assert NaiveRewardManager(tokenizer, 0)(data) is data.batch["rm_scores"]
    assert (
        NaiveRewardManager(tokenizer, 0)(data, return_dict=True)["reward_tensor"] is data.batch["rm_scores"]
    )


def test_num_examine_prints_per_data_source(tokenizer, capsys):
    NaiveRewardManager(tokenizer, num_examine=1)(make_batch(tokenizer, ["132", "4"], ["132", "5"]))
    out = capsys.readouterr().out
    assert out.count("[response]") == 1
    assert "[prompt] user\nWhat is 0 + 1?" in out and "[ground_truth] 132" in out and "[score] 1.0" in out


# ------------------------------------------------------------------------------------ bad scores
@pytest.mark.parametrize(
    "scorer, problem", [(raise_on_seven, "RuntimeError: verifier crashed"), (nan_on_seven, "nan")]
)
def test_bad_scores_raise_with_context(tokenizer, scorer, problem):
    data = make_batch(tokenizer, ["1", "77", "3"], ["1", "2", "3"])
    with pytest.raises(RewardScoreError, match=rf"{SOURCE}'?, sample 1: .*{problem}.*'77'.*ground_truth='2'"):
        NaiveRewardManager(tokenizer, 0, compute_score=scorer)(data)


@pytest.mark.parametrize("scorer", [raise_on_seven, nan_on_seven])
def test_bad_scores_zeroed_and_counted_when_asked(tokenizer, scorer, caplog):
    data = make_batch(tokenizer, ["1", "77", "7"], ["1", "2", "3"])
    manager = NaiveRewardManager(tokenizer, 0, compute_score=scorer, on_score_error="zero")
    with caplog.at_level("WARNING"):
        out = manager(data, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0, 0.0]
    assert out["reward_extra_info"]["score_error"] == [0, 1, 1]
    assert len([r for r in caplog.records if "scoring errors" in r.message]) == 1


def test_unknown_on_score_error_mode(tokenizer):
    with pytest.raises(ValueError, match="raise.*zero"):
        NaiveRewardManager(tokenizer, 0, on_score_error="ignore")


# ------------------------------------------------------------------------------------------- batch
def test_batch_manager_calls_once(tokenizer):
    calls = []

    def batch_scorer(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        calls.append(list(solution_strs))
        return [float(s == g) + bonus for s, g in zip(solution_strs, ground_truths)]

    data = make_batch(tokenizer, ["12", "4"], ["12", "5"])
    reward = BatchRewardManager(tokenizer, 0, compute_score=batch_scorer, bonus=0.5)(data)
    assert calls == [["12", "4"]]
    assert reward[0, 1] == 1.5 and reward[1, 0] == 0.5 and reward.count_nonzero() == 2
    assert BatchRewardManager(tokenizer, 0)(data).sum() == 1.0  # default: default_compute_score per sample


def test_batch_manager_length_mismatch_and_errors(tokenizer):
    data = make_batch(tokenizer, ["1", "2"], ["1", "2"])
    with pytest.raises(ValueError, match="1 scores for 2 samples"):
        BatchRewardManager(tokenizer, 0, compute_score=lambda **kw: [1.0])(data)

    def broken(**kwargs):
        raise OSError("judge down")

    with pytest.raises(RewardScoreError, match="judge down"):
        BatchRewardManager(tokenizer, 0, compute_score=broken)(data)
    out = BatchRewardManager(tokenizer, 0, compute_score=broken, on_score_error="zero")(
        data, return_dict=True
    )
    assert out["reward_extra_info"]["score_error"] == [1, 1] and out["reward_tensor"].sum() == 0


# -------------------------------------------------------------------------------------------- dapo
def test_dapo_overlong_penalty_by_hand(tokenizer):
    # max_resp_len 8, buffer 4: no penalty up to 4 tokens, then -(L - 4) / 4 * 0.5
    data = make_batch(tokenizer, ["123", "12345", "1234567", "12345678"], ["0"] * 4)
    cfg = {"enable": True, "len": 4, "penalty_factor": 0.5, "log": True}
    manager = DAPORewardManager(
        tokenizer, 0, compute_score=constant_one, max_resp_len=8, overlong_buffer_cfg=cfg
    )
    out = manager(data, return_dict=True)
    assert out["reward_extra_info"]["overlong_reward"] == [0.0, -0.125, -0.375, -0.5]
    assert out["reward_extra_info"]["overlong"] == [False, True, True, True]
    rewards = out["reward_tensor"]
    assert [rewards[0, 2].item(), rewards[1, 4].item(), rewards[2, 6].item(), rewards[3, 7].item()] == [
        1.0,
        0.875,
        0.625,
        0.5,
    ]


def test_dapo_disabled_is_naive_and_enabled_needs_max_len(tokenizer):
    data = make_batch(tokenizer, ["12345678"], ["12345678"])
    assert DAPORewardManager(tokenizer, 0)(data).sum() == 1.0
    assert (
        DAPORewardManager(tokenizer, 0, overlong_buffer_cfg={"enable": False})(data, True)[
            "reward_extra_info"
        ]
        == {}
    )
    with pytest.raises(ValueError, match="max_resp_len"):
        DAPORewardManager(tokenizer, 0, overlong_buffer_cfg={"enable": True, "len": 4})


# ------------------------------------------------------------------------------------------- prime
def test_prime_scores_in_parallel_and_times_out(tokenizer):
    data = make_batch(tokenizer, ["12", "19", "3", "4"], ["12", "19", "3", "5"])
    manager = PrimeRewardManager(
        tokenizer, 0, compute_score=sleep_on_nine, num_processes=2, score_timeout_s=1.0, on_score_error="zero"
    )
    start = time.monotonic()
    out = manager(data, return_dict=True)
    assert time.monotonic() - start < 15
    assert out["reward_extra_info"]["timed_out"] == [0, 1, 0, 0]
    assert out["reward_extra_info"]["score_error"] == [0, 1, 0, 0]
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out["reward_extra_info"]["pid_marker"] == [1, None, 1, 1]


def test_prime_reports_scorer_errors_and_needs_picklable_scorers(tokenizer):
    data = make_batch(tokenizer, ["1", "7"], ["1", "7"])
    with pytest.raises(RewardScoreError, match="sample 1: scorer raised RuntimeError"):
        PrimeRewardManager(tokenizer, 0, compute_score=raise_on_seven, num_processes=2)(data)
    assert PrimeRewardManager(tokenizer, 0, num_processes=1)(data).sum() == 2.0  # default scorer
    with pytest.raises(TypeError, match="picklable"):
        PrimeRewardManager(tokenizer, 0, compute_score=lambda **kw: 1.0)


def hang_with_alarm_blocked(data_source, solution_str, ground_truth, extra_info=None):
    """Stands in for a scorer stuck in C code: no timeout signal can interrupt it."""
    if "9" in solution_str:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, TIMEOUT_SIGNAL})
        time.sleep(60)
    return 1.0


def test_prime_backstop_kills_workers_stuck_beyond_the_alarm(tokenizer, monkeypatch):
    monkeypatch.setattr(prime_module, "BACKSTOP_GRACE_S", 1.0)
    data = make_batch(tokenizer, ["1", "9"], ["1", "9"])
    manager = PrimeRewardManager(
        tokenizer,
        0,
        compute_score=hang_with_alarm_blocked,
        num_processes=2,
        score_timeout_s=0.5,
        on_score_error="zero",
    )
    start = time.monotonic()
    out = manager(data, return_dict=True)
    assert time.monotonic() - start < 10
    assert out["reward_extra_info"]["timed_out"] == [0, 1]
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0]


# --------------------------------------------------------------------------------- custom / build
CUSTOM_SOURCE = """
def my_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return 0.25 * scale

def helper():
    return None
"""


def test_load_custom_reward_function(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_SOURCE)
    fn = load_custom_reward_function(str(path), "my_score")
    assert fn("x", "1", "1") == 0.25
    assert load_custom_reward_function(None) is None
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_custom_reward_function(str(tmp_path / "nope.py"))
    with pytest.raises(AttributeError, match=r"no function 'compute_score'.*\['helper', 'my_score'\]"):
        load_custom_reward_function(str(path))


def test_build_reward_manager_from_verl_keys(tmp_path, tokenizer):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_SOURCE)
    custom = {"path": str(path), "name": "my_score", "reward_kwargs": {"scale": 2.0}}
    naive = build_reward_manager({"reward_manager": "naive"}, custom, tokenizer, num_examine=0)
    assert isinstance(naive, NaiveRewardManager)
    assert naive(make_batch(tokenizer, ["1"], ["1"])).sum() == 0.5

    dapo_cfg = {
        "reward_manager": "dapo",
        "overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 1.0, "log": False},
        "on_score_error": "zero",
    }
    dapo = build_reward_manager(dapo_cfg, None, tokenizer, num_examine=0, max_resp_len=8)
    assert isinstance(dapo, DAPORewardManager) and dapo.max_resp_len == 8 and dapo.on_score_error == "zero"
    prime = build_reward_manager(
        {"reward_manager": "prime", "reward_kwargs": {"num_processes": 1}}, {}, tokenizer, 0
    )
    assert isinstance(prime, PrimeRewardManager) and prime.num_processes == 1

    with pytest.raises(ValueError, match="use reward_model.reward_manager=dapo"):
        build_reward_manager(
            {"overlong_buffer": {"enable": True, "len": 4}}, None, tokenizer, 0, max_resp_len=8
        )
    with pytest.raises(KeyError, match="Unknown reward manager: nope. Registered: batch, dapo, naive, prime"):
        get_reward_manager_cls("nope")


def test_custom_function_from_file_runs_in_prime_workers(tmp_path, tokenizer):
    path = tmp_path / "file_reward.py"
    path.write_text(CUSTOM_SOURCE)
    cfg = {"reward_manager": "prime", "reward_kwargs": {"num_processes": 2}, "score_timeout_s": 10}
    manager = build_reward_manager(cfg, {"path": str(path), "name": "my_score"}, tokenizer, 0)
    reward = manager(make_batch(tokenizer, ["1", "2"], ["1", "2"]))
    assert math.isclose(reward.sum().item(), 0.5)
