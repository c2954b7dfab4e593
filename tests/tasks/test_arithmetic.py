"""The built-in arithmetic task: deterministic splits, no train/test overlap, weak-teacher error rate."""

import random

import pyarrow.parquet as pq
import pytest

from hybridflow.tasks.arithmetic import (
    ArithmeticTaskConfig,
    generate_splits,
    main,
    make_problem,
    needs_carry,
    no_carry_answer,
    task_texts,
    write_rl_dataset,
    write_sft_dataset,
)
from hybridflow.utils.reward_score import default_compute_score

SMALL = ArithmeticTaskConfig(num_train=3000, num_test=200)


def key(extra_info):
    return extra_info["a"], extra_info["op"], extra_info["b"]


def test_same_config_gives_identical_files(tmp_path):
    first = write_rl_dataset(tmp_path / "a", SMALL)
    second = write_rl_dataset(tmp_path / "b", SMALL)
    for x, y in zip(first, second):
        assert x.read_bytes() == y.read_bytes()
    other = write_rl_dataset(tmp_path / "c", ArithmeticTaskConfig(num_train=3000, num_test=200, seed=1))
    assert other[0].read_bytes() != first[0].read_bytes()


def test_rows_follow_verl_schema_and_ground_truth_is_right(tmp_path):
    train_path, test_path = write_rl_dataset(tmp_path, SMALL)
    rows = pq.read_table(train_path).to_pylist()
    assert len(rows) == 3000 and pq.read_table(test_path).num_rows == 200
    row = rows[7]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "hybridflow/arithmetic" and row["ability"] == "math"
    a, op, b = key(row["extra_info"])
    assert row["prompt"] == [{"role": "user", "content": f"What is {a} {op} {b}? {SMALL.instruction}"}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 7
    assert all(10 <= r["extra_info"]["a"] <= 99 and 10 <= r["extra_info"]["b"] <= 99 for r in rows)
    assert default_compute_score(row["data_source"], str(a + b), row["reward_model"]["ground_truth"]) == 1.0


def test_train_never_contains_a_test_problem():
    train, test = generate_splits(SMALL)
    test_keys = {(p["a"], p["op"], p["b"]) for p in test}
    assert len(test_keys) == len(test) == 200  # distinct test problems
    assert not test_keys & {(p["a"], p["op"], p["b"]) for p in train}


def test_subtraction_keeps_answers_non_negative_and_digit_ranges():
    cfg = ArithmeticTaskConfig(min_digits=1, max_digits=3, ops=("+", "-", "*"))
    rng = random.Random(0)
    problems = [make_problem(rng, cfg) for _ in range(500)]
    assert {p["op"] for p in problems} == {"+", "-", "*"}
    assert all(p["answer"] >= 0 for p in problems if p["op"] == "-")
    assert {len(str(p["a"])) for p in problems} == {1, 2, 3}


def test_carry_free_answers_by_hand():
    assert no_carry_answer(47, "+", 85) == 22  # 7+5=12 -> 2, 4+8=12 -> 2, carries dropped; correct 132
    assert no_carry_answer(52, "-", 38) == 24  # (2-8) mod 10 = 4, 5-3 = 2; correct 14
    assert no_carry_answer(105, "+", 7) == 102  # different lengths: 5+7 -> 2, 0+0, 1+0
    assert needs_carry(47, "+", 85) and needs_carry(52, "-", 38)
    assert not needs_carry(12, "+", 13) and not needs_carry(58, "-", 23) and not needs_carry(12, "*", 13)


def test_weak_teacher_errs_only_on_carries_at_the_given_rate(tmp_path):
    path = write_sft_dataset(tmp_path, SMALL, num_examples=2000, teacher_carry_error_rate=0.5, seed=3)
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 2000 and {"prompt", "response", "correct"} <= set(rows[0])
    carry = [r for r in rows if needs_carry(*key(r["extra_info"]))]
    plain = [r for r in rows if not needs_carry(*key(r["extra_info"]))]
    assert len(carry) > 1000 and len(plain) > 300  # two 2-digit addends usually carry
    assert all(r["correct"] and r["response"] == r["reward_model"]["ground_truth"] for r in plain)
    wrong = [r for r in carry if not r["correct"]]
    assert abs(len(wrong) / len(carry) - 0.5) < 0.06  # binomial sd ~0.013 at n~1500
    assert all(r["response"] == str(no_carry_answer(*key(r["extra_info"]))) for r in wrong)
    assert all(r["response"] != r["reward_model"]["ground_truth"] for r in wrong)
    _, test = generate_splits(SMALL)
    test_keys = {(p["a"], p["op"], p["b"]) for p in test}
    assert not test_keys & {key(r["extra_info"]) for r in rows}


@pytest.mark.parametrize("rate, expected_wrong_fraction", [(0.0, 0.0), (1.0, 1.0)])
def test_weak_teacher_extremes(tmp_path, rate, expected_wrong_fraction):
    rows = pq.read_table(write_sft_dataset(tmp_path, SMALL, 300, teacher_carry_error_rate=rate)).to_pylist()
    carry = [r for r in rows if needs_carry(*key(r["extra_info"]))]
    assert sum(not r["correct"] for r in carry) == expected_wrong_fraction * len(carry)
    assert all(r["response"].isdigit() for r in rows)


def test_config_validation():
    with pytest.raises(ValueError, match="unknown ops"):
        ArithmeticTaskConfig(ops=("/",))
    with pytest.raises(ValueError, match="min_digits"):
        ArithmeticTaskConfig(min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="num_test"):
        generate_splits(ArithmeticTaskConfig(min_digits=1, max_digits=1, num_test=80))
    with pytest.raises(ValueError, match="teacher_carry_error_rate"):
        write_sft_dataset("/tmp/unused", SMALL, 10, teacher_carry_error_rate=1.5)


def test_task_texts_cover_prompts_answers_and_roles():
    texts = task_texts(SMALL, n=50)
    assert len(texts) == 51 and any("system" in t for t in texts)
    assert all("user\nWhat is " in t and "\nassistant\n" in t for t in texts[1:])


def test_cli(tmp_path, capsys):
    main(
        ["--out", str(tmp_path), "--num-train", "50", "--num-test", "10", "--ops", "+-", "--max-digits", "3"]
    )
    assert "train.parquet" in capsys.readouterr().out
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == 50 and {r["extra_info"]["op"] for r in rows} == {"+", "-"}


def test_second_operand_digit_range():
    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, generate_splits

    cfg = ArithmeticTaskConfig(num_train=300, num_test=50, b_digits=(1, 1))
    train, test = generate_splits(cfg)
    assert all(10 <= p["a"] <= 99 and 0 <= p["b"] <= 9 for p in train + test)
    assert {(p["a"], p["b"]) for p in test}.isdisjoint({(p["a"], p["b"]) for p in train})
