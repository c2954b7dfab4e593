"""Labelled pairs for a generative judge (GenRM) of the arithmetic task, and the judge's verdict parser.

A pair is a problem of :mod:`hybridflow.tasks.arithmetic` with a candidate answer; the judge is asked
:func:`judge_question` (``"What is 47 + 5? Proposed answer: 52. Correct or incorrect?"``) and is taught
to answer :func:`judge_answer`: the sum it computes, then its verdict (``"52 correct"``,
``"42 incorrect"`` for the candidate ``"42"``). Working the sum out before the verdict is a short chain
of thought: a tiny model learns it as fast as the task itself, where a bare verdict would have to carry
the addition inside one token. :func:`parse_verdict` reads the verdict from the judge's last word.

Candidates (:func:`candidate_answers`): the right answer half the time, else one of the mistakes a
policy makes: the carry-free answer (``47 + 5`` → ``42``, the quickstart's weak teacher), off by one,
off by ten, a random number, or a malformed answer (empty, a trailing digit, words) so a policy cannot
earn "correct" with garbage. Pairs come from the train problems only; :func:`write_judge_datasets`
holds out pairs on the test problems for measuring the judge.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from hybridflow.tasks.arithmetic import (
    ArithmeticTaskConfig,
    _problem_key,
    _sample_excluding,
    _write_parquet,
    generate_splits,
    needs_carry,
    no_carry_answer,
)

CORRECT, INCORRECT = "correct", "incorrect"
MISTAKES = ("carry_free", "off_by_one", "off_by_ten", "random", "malformed")


def judge_question(a: int, op: str, b: int, candidate: str) -> str:
    """The judge's prompt for the problem ``a op b`` and the policy's ``candidate`` answer (as written)."""
    return f"What is {a} {op} {b}? Proposed answer: {candidate.strip()}. Correct or incorrect?"


def judge_answer(answer: int, candidate: str) -> str:
    """What the judge is taught to reply: the sum, then ``correct`` iff the candidate is exactly it."""
    return f"{answer} {CORRECT if candidate.strip() == str(answer) else INCORRECT}"


def parse_verdict(text: str) -> float:
    """1.0 when the judge's reply ends with the word ``correct``, else 0.0 (``incorrect``, empty, garbage)."""
    words = text.strip().rstrip(".!").lower().split()
    return 1.0 if words and words[-1] == CORRECT else 0.0


def wrong_answer(problem: dict, kind: str, rng: random.Random) -> str:
    """A wrong candidate of ``kind`` (one of :data:`MISTAKES`) for ``problem``; never the right answer."""
    a, op, b, answer = problem["a"], problem["op"], problem["b"], problem["answer"]
    if kind == "carry_free" and needs_carry(a, op, b):
        candidate = str(no_carry_answer(a, op, b))
    elif kind == "off_by_ten":
        candidate = str(answer + rng.choice((-10, 10)) if answer >= 10 else answer + 10)
    elif kind == "random":
        candidate = str(rng.randint(0, 2 * max(answer, 9)))
    elif kind == "malformed":
        candidate = rng.choice(["", f"{answer}{rng.randint(0, 9)}", f"{answer // 10}", "the answer", "?"])
    else:  # off_by_one, and carry_free on a problem without a carry
        candidate = str(answer + rng.choice((-1, 1)) if answer > 0 else 1)
    if candidate.strip() == str(answer):  # e.g. a random draw that hit the answer
        candidate = str(answer + 1)
    return candidate


def candidate_answers(problem: dict, rng: random.Random, p_correct: float = 0.5) -> tuple[str, str]:
    """``(candidate, mistake)``: the right answer with probability ``p_correct`` (mistake ``"none"``),
    else a :func:`wrong_answer` of a uniformly drawn kind."""
    if rng.random() < p_correct:
        return str(problem["answer"]), "none"
    kind = rng.choice(MISTAKES)
    if kind == "carry_free" and not needs_carry(problem["a"], problem["op"], problem["b"]):
        kind = "off_by_one"  # no carry: the carry-free answer is the right one
    return wrong_answer(problem, kind, rng), kind


def judge_row(problem: dict, candidate: str, mistake: str, index: int) -> dict:
    """One SFT row (``prompt`` chat messages, ``response``) with the label: ``label`` 1 iff correct."""
    answer = judge_answer(problem["answer"], candidate)
    return {
        "prompt": [
            {"role": "user", "content": judge_question(problem["a"], problem["op"], problem["b"], candidate)}
        ],
        "response": answer,
        "label": int(answer.endswith(f" {CORRECT}")),
        "mistake": mistake,
        "extra_info": {"index": index, "a": problem["a"], "op": problem["op"], "b": problem["b"]},
    }


def judge_pairs(problems: list[dict], seed: int, p_correct: float = 0.5) -> list[dict]:
    """One labelled row per problem (:func:`judge_row`), candidates drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [judge_row(p, *candidate_answers(p, rng, p_correct), i) for i, p in enumerate(problems)]


def write_judge_datasets(
    out_dir: str | Path, cfg: ArithmeticTaskConfig, num_train: int = 12800, seed: int = 7
) -> tuple[Path, Path]:
    """``judge_train.parquet`` (pairs on train problems, never a test problem) and ``judge_test.parquet``
    (one pair per test problem, held out): the judge's SFT set and its accuracy set."""
    _, test = generate_splits(cfg)
    rng = random.Random(seed)
    train = _sample_excluding(rng, cfg, num_train, {_problem_key(p) for p in test})
    out = Path(out_dir)
    return (
        _write_parquet(judge_pairs(train, seed + 1), out / "judge_train.parquet"),
        _write_parquet(judge_pairs(test, seed + 2), out / "judge_test.parquet"),
    )


def judge_texts(cfg: ArithmeticTaskConfig, n: int = 500, seed: int = 3) -> list[str]:
    """Chat texts of judge pairs, to train the shared tokenizer on (so the verdict words are tokens)."""
    train, _ = generate_splits(dataclasses.replace(cfg, num_train=n))
    rows = judge_pairs(train, seed)
    return [f"user\n{r['prompt'][0]['content']}\nassistant\n{r['response']}\n" for r in rows]
