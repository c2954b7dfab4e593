"""The GenRM judge's labelled pairs (hybridflow/tasks/arithmetic_judge.py): every label is the truth of the
candidate, the mistakes are what they say, held-out pairs never share a problem with the SFT pairs, and the
verdict parser reads the judge's last word."""

import random

import pyarrow.parquet as pq
import pytest

from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, generate_splits, needs_carry, no_carry_answer
from hybridflow.tasks.arithmetic_judge import (
    MISTAKES,
    judge_pairs,
    judge_question,
    parse_verdict,
    write_judge_datasets,
    wrong_answer,
)

CFG = ArithmeticTaskConfig(num_train=2000, num_test=100, b_digits=(1, 1), instruction="")


def _candidate(row) -> str:
    return row["prompt"][0]["content"].split("Proposed answer: ")[1].rsplit(". Correct or incorrect?", 1)[0]


def test_every_label_is_the_truth_of_its_candidate():
    train, _ = generate_splits(CFG)
    rows = judge_pairs(train, seed=5)
    kinds = {row["mistake"] for row in rows}
    assert kinds == {"none", *MISTAKES}
    for row, problem in zip(rows, train, strict=True):
        candidate, answer = _candidate(row), str(problem["answer"])
        assert row["label"] == int(candidate == answer) == int(row["mistake"] == "none"), row
        assert row["response"] == f"{answer} {'correct' if row['label'] else 'incorrect'}"  # the sum first
        if row["mistake"] == "carry_free":
            assert needs_carry(problem["a"], "+", problem["b"])
            assert candidate == str(no_carry_answer(problem["a"], "+", problem["b"]))
        if row["mistake"] in ("off_by_one", "off_by_ten"):
            assert abs(int(candidate) - problem["answer"]) == (1 if row["mistake"] == "off_by_one" else 10)
    assert 0.4 < sum(row["label"] for row in rows) / len(rows) < 0.6  # about half right


def test_a_wrong_answer_is_never_right():
    rng = random.Random(0)
    for problem in generate_splits(CFG)[0][:300]:
        for kind in MISTAKES:
            assert wrong_answer(problem, kind, rng).strip() != str(problem["answer"]), (problem, kind)


def test_held_out_pairs_are_on_test_problems_only(tmp_path):
    train_file, test_file = write_judge_datasets(tmp_path, CFG, num_train=500)
    key = lambda row: (row["extra_info"]["a"], row["extra_info"]["b"])  # noqa: E731
    train = {key(r) for r in pq.read_table(train_file).to_pylist()}
    test = [key(r) for r in pq.read_table(test_file).to_pylist()]
    assert len(test) == CFG.num_test and not train & set(test)
    assert {(p["a"], p["b"]) for p in generate_splits(CFG)[1]} == set(test)


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("52 correct", 1.0),
        ("52 Correct.", 1.0),
        ("correct", 1.0),
        ("52 incorrect", 0.0),
        ("correct 52", 0.0),
        ("52 incorrectly", 0.0),
        ("", 0.0),
        ("  ", 0.0),
        ("5 2 7", 0.0),
    ],
)
def test_parse_verdict_reads_the_last_word(reply, score):
    assert parse_verdict(reply) == score


def test_judge_question_holds_the_problem_and_the_answer_as_written():
    assert judge_question(47, "+", 5, " 52 ") == "What is 47 + 5? Proposed answer: 52. Correct or incorrect?"
