"""The built-in multi-digit arithmetic task: generated offline, deterministic, checkable by a rule.

Problems look like ``"What is 47 + 85? Compute the result. Reply with the number only."`` and the
expected answer is the bare number (``"132"``). Every split is produced from a seeded
``random.Random``, so the same :class:`ArithmeticTaskConfig` always yields byte-identical parquet
files. The test split is drawn first and the train split never contains a test problem.

Subtraction keeps ``a >= b`` (answers are never negative) so that the weak teacher's "forgot to
borrow" error below is well defined.

**Weak teacher** (:func:`write_sft_dataset`): with probability ``teacher_carry_error_rate``, on a
problem whose correct column-wise computation needs a carry (``+``) or a borrow (``-``), the teacher
writes the answer computed digit by digit *without* propagating carries/borrows: each output digit
is ``(a_i + b_i) mod 10`` (or ``(a_i - b_i) mod 10``), and the final carry out of the top column
is dropped too. E.g. ``47 + 85`` → ``22`` (correct ``132``), ``52 - 38`` → ``24`` (correct ``14``).
Problems without carries, and ``*``, are always answered correctly. This gives an SFT model a
systematic, measurable flaw that RL with the rule reward can fix.

Rows follow verl's parquet schema (``data_source``, ``prompt``, ``ability``, ``reward_model``,
``extra_info``) so :class:`hybridflow.utils.dataset.RLHFDataset` reads them unchanged.
"""

from __future__ import annotations

import argparse
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "hybridflow/arithmetic"
ABILITY = "math"

# op symbol -> exact integer function; extend here to add an operation.
OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# op symbol -> digit-wise function of the carry-free "weak teacher" (only ops that carry/borrow).
NO_CARRY_DIGIT_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda x, y: (x + y) % 10,
    "-": lambda x, y: (x - y) % 10,
}


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    """How problems are generated."""

    min_digits: int = 2
    """Fewest digits of each operand."""
    max_digits: int = 2
    """Most digits of each operand (each operand draws its own length)."""
    b_digits: tuple[int, int] | None = None
    """``(min, max)`` digits of the second operand when it differs from the first (e.g. ``(1, 1)``)."""
    ops: tuple[str, ...] = ("+",)
    """Operations to sample from, keys of ``OPS``."""
    num_train: int = 20000
    """Train rows (drawn with replacement from the problems not in the test split)."""
    num_test: int = 200
    """Test rows (distinct problems, carved out first)."""
    seed: int = 0
    """Seed of the ``random.Random`` generating both splits."""
    instruction: str = "Compute the result. Reply with the number only."
    """Appended to every question; empty string for none."""

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise ValueError(
                f"ArithmeticTaskConfig.ops={self.ops!r}: unknown ops {unknown}; known: {list(OPS)}"
            )
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if self.b_digits is not None and not 1 <= self.b_digits[0] <= self.b_digits[1]:
            raise ValueError(f"need 1 <= b_digits[0] <= b_digits[1], got {self.b_digits}")

    def digit_range(self, operand: str) -> tuple[int, int]:
        """``(min, max)`` digits of operand ``"a"`` or ``"b"``."""
        if operand == "b" and self.b_digits is not None:
            return self.b_digits
        return self.min_digits, self.max_digits


def _operand(rng: random.Random, cfg: ArithmeticTaskConfig, operand: str = "a") -> int:
    digits = rng.randint(*cfg.digit_range(operand))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_problem(rng: random.Random, cfg: ArithmeticTaskConfig) -> dict:
    """One problem ``{"a", "op", "b", "answer"}``; for ``-`` the operands are ordered so ``a >= b``."""
    a, b, op = _operand(rng, cfg, "a"), _operand(rng, cfg, "b"), rng.choice(cfg.ops)
    if op == "-" and a < b:
        a, b = b, a
    return {"a": a, "op": op, "b": b, "answer": OPS[op](a, b)}


def format_question(problem: dict, cfg: ArithmeticTaskConfig) -> str:
    """``"What is 47 + 85? <instruction>"``."""
    question = f"What is {problem['a']} {problem['op']} {problem['b']}?"
    return f"{question} {cfg.instruction}" if cfg.instruction else question


def _problem_key(problem: dict) -> tuple:
    return problem["a"], problem["op"], problem["b"]


def _num_distinct_problems(cfg: ArithmeticTaskConfig) -> int:
    """Upper bound on distinct (a, op, b) triples (ordering ``-`` operands makes the true count smaller)."""

    def count(operand: str) -> int:
        low, high = cfg.digit_range(operand)
        return sum(9 * 10 ** (d - 1) + (1 if d == 1 else 0) for d in range(low, high + 1))

    return count("a") * count("b") * len(cfg.ops)


def generate_splits(cfg: ArithmeticTaskConfig) -> tuple[list[dict], list[dict]]:
    """``(train, test)`` problem lists: test has distinct problems, train never contains one of them."""
    space = _num_distinct_problems(cfg)
    if cfg.num_test > space // 2:  # rejection sampling below needs plenty of unused problems
        raise ValueError(f"num_test={cfg.num_test} is over half of the ~{space} distinct problems; use fewer")
    rng = random.Random(cfg.seed)
    test, test_keys = [], set()
    while len(test) < cfg.num_test:
        problem = make_problem(rng, cfg)
        if _problem_key(problem) not in test_keys:
            test_keys.add(_problem_key(problem))
            test.append(problem)
    return _sample_excluding(rng, cfg, cfg.num_train, test_keys), test


def _sample_excluding(rng: random.Random, cfg: ArithmeticTaskConfig, n: int, excluded: set) -> list[dict]:
    out = []
    while len(out) < n:
        problem = make_problem(rng, cfg)
        if _problem_key(problem) not in excluded:
            out.append(problem)
    return out


def make_row(problem: dict, cfg: ArithmeticTaskConfig, split: str, index: int) -> dict:
    """One row in verl's RL parquet schema."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": format_question(problem, cfg)}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(problem["answer"])},
        "extra_info": {
            "split": split,
            "index": index,
            "a": problem["a"],
            "op": problem["op"],
            "b": problem["b"],
        },
    }


def _write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_rl_dataset(out_dir: str | Path, cfg: ArithmeticTaskConfig | None = None) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir``; returns their paths."""
    cfg = cfg or ArithmeticTaskConfig()
    train, test = generate_splits(cfg)
    out = Path(out_dir)
    train_path = _write_parquet(
        [make_row(p, cfg, "train", i) for i, p in enumerate(train)], out / "train.parquet"
    )
    test_path = _write_parquet(
        [make_row(p, cfg, "test", i) for i, p in enumerate(test)], out / "test.parquet"
    )
    return train_path, test_path


def _digits(n: int, width: int) -> list[int]:
    """Least-significant-first digits of ``n``, zero-padded to ``width``."""
    return [(n // 10**i) % 10 for i in range(width)]


def needs_carry(a: int, op: str, b: int) -> bool:
    """True when the column-wise computation of ``a op b`` carries (``+``) or borrows (``-``)."""
    if op not in NO_CARRY_DIGIT_OPS:
        return False
    return no_carry_answer(a, op, b) != OPS[op](a, b)


def no_carry_answer(a: int, op: str, b: int) -> int:
    """The weak teacher's answer: each column computed mod 10, carries/borrows never propagated."""
    width = max(len(str(a)), len(str(b)))
    digit_op = NO_CARRY_DIGIT_OPS[op]
    columns = [digit_op(x, y) for x, y in zip(_digits(a, width), _digits(b, width))]
    return sum(d * 10**i for i, d in enumerate(columns))


def write_sft_dataset(
    out_dir: str | Path,
    cfg: ArithmeticTaskConfig | None = None,
    num_examples: int = 2000,
    teacher_carry_error_rate: float = 0.0,
    seed: int = 1,
) -> Path:
    """Write ``sft.parquet``: ``prompt`` (chat messages), ``response`` (answer digits), ``correct``.

    Problems come from the train distribution only (never a test problem). With probability
    ``teacher_carry_error_rate`` a carry/borrow problem gets the carry-free answer (module docstring).
    ``reward_model``/``data_source``/``extra_info`` ride along (``extra_info["teacher_error"]``).
    """
    cfg = cfg or ArithmeticTaskConfig()
    if not 0.0 <= teacher_carry_error_rate <= 1.0:
        raise ValueError(f"teacher_carry_error_rate must be in [0, 1], got {teacher_carry_error_rate}")
    _, test = generate_splits(cfg)
    rng = random.Random(seed)
    problems = _sample_excluding(rng, cfg, num_examples, {_problem_key(p) for p in test})
    rows = []
    for i, p in enumerate(problems):
        wrong = needs_carry(p["a"], p["op"], p["b"]) and rng.random() < teacher_carry_error_rate
        answer = no_carry_answer(p["a"], p["op"], p["b"]) if wrong else p["answer"]
        row = make_row(p, cfg, "sft", i)
        row["extra_info"]["teacher_error"] = wrong
        rows.append({**row, "response": str(answer), "correct": not wrong})
    return _write_parquet(rows, Path(out_dir) / "sft.parquet")


def task_texts(cfg: ArithmeticTaskConfig | None = None, n: int = 2000, seed: int = 0) -> list[str]:
    """Sample texts (questions, answers, chat role words) to train a tokenizer on."""
    cfg = cfg or ArithmeticTaskConfig()
    rng = random.Random(seed)
    texts = ["system\nYou are a helpful assistant.\n"]
    for _ in range(n):
        p = make_problem(rng, cfg)
        texts.append(f"user\n{format_question(p, cfg)}\nassistant\n{p['answer']}\n")
    return texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the arithmetic RL dataset (train/test parquet).")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-train", type=int, default=ArithmeticTaskConfig.num_train)
    parser.add_argument("--num-test", type=int, default=ArithmeticTaskConfig.num_test)
    parser.add_argument("--min-digits", type=int, default=ArithmeticTaskConfig.min_digits)
    parser.add_argument("--max-digits", type=int, default=ArithmeticTaskConfig.max_digits)
    parser.add_argument("--ops", default="+", help="operation characters, e.g. '+-'")
    parser.add_argument("--seed", type=int, default=ArithmeticTaskConfig.seed)
    parser.add_argument("--sft-examples", type=int, default=0, help="also write sft.parquet with N rows")
    parser.add_argument("--teacher-carry-error-rate", type=float, default=0.0)
    args = parser.parse_args(argv)
    cfg = ArithmeticTaskConfig(
        min_digits=args.min_digits,
        max_digits=args.max_digits,
        ops=tuple(args.ops),
        num_train=args.num_train,
        num_test=args.num_test,
        seed=args.seed,
    )
    for path in write_rl_dataset(args.out, cfg):
        print(f"wrote {path}")
    if args.sft_examples:
        print(f"wrote {write_sft_dataset(args.out, cfg, args.sft_examples, args.teacher_carry_error_rate)}")


if __name__ == "__main__":
    main()
