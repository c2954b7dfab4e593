"""Data for the GSM8K / SmolLM2-135M-Instruct GRPO recipe: two tasks in verl's RL parquet schema.

1. **GSM8K** (``data_source="openai/gsm8k"``), rows made by ``examples/data_preprocess/gsm8k.py``
   (verl's prompt: the question plus ``Let's think step by step and output the final answer after
   "####".``; ground truth = the number after ``####``):
   ``<out>/gsm8k/train.parquet`` (all 7,473), ``<out>/gsm8k/test.parquet`` (all 1,319) and
   ``<out>/gsm8k/test200.parquet`` = the FIRST 200 rows of ``test.jsonl`` in file order (fixed,
   no sampling).
2. **A reasoning-gym task** (``data_source="reasoning_gym/<name>"``), a preset of
   :data:`RG_PRESETS` (default :data:`DEFAULT_RG_PRESET`), written to ``<out>/<preset>/train.parquet``
   and ``<out>/<preset>/test200.parquet``. The test set is the first 200 *distinct* questions of
   ``create_dataset(name, seed=TEST_SEED)``; the train set is the first ``--rg_train_size``
   distinct questions of ``seed=TRAIN_SEED`` that are not in the test set (train and test are
   disjoint by question text). Score it with ``examples/gsm8k_smollm2/reward.py``.

Every row: ``data_source``, ``prompt`` (one user message), ``ability``,
``reward_model={"style": "rule", "ground_truth": str}``, ``extra_info`` (``split``, ``index``,
``question``, ``answer``; reasoning-gym rows add ``metadata`` as a JSON string).

GSM8K is read from ``--gsm8k_dir`` (default ``~/data/gsm8k_jsonl``): OpenAI's ``train.jsonl`` and
``test.jsonl`` from github.com/openai/grade-school-math (``grade_school_math/data``), downloaded as
docs/models_and_data.md shows. The reasoning-gym task needs no download (``pip install reasoning-gym``,
the ``recipes`` extra).

    python examples/gsm8k_smollm2/prepare_data.py --gsm8k_dir ~/data/gsm8k_jsonl \
        --output_dir ~/data/gsm8k_smollm2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GSM8K_SCRIPT = REPO / "examples" / "data_preprocess" / "gsm8k.py"
DEFAULT_GSM8K_DIR = "~/data/gsm8k_jsonl"  # GSM8K's train.jsonl and test.jsonl (docs/models_and_data.md)
DEFAULT_OUTPUT_DIR = "~/data/gsm8k_smollm2"

GSM8K_TEST_SUBSET = 200  # first N rows of test.jsonl, in file order
RG_TEST_SIZE = 200
RG_TRAIN_SIZE = 5000
TRAIN_SEED = 0
TEST_SEED = 1_000_000  # far from TRAIN_SEED: many generators seed item i with Random(seed + i)

# Short instruction appended to every reasoning-gym question (responses must stay short on CPU).
RG_INSTRUCTION = 'Give the final answer after "####".'


def _arithmetic(
    terms: tuple[int, int], digits: tuple[int, int], operators: tuple[str, ...]
) -> tuple[str, dict]:
    """A ``basic_arithmetic`` config: non-negative operands, no parentheses ("Calculate 74 + 2.")."""
    config = dict(min_terms=terms[0], max_terms=terms[1], min_digits=digits[0], max_digits=digits[1])
    return "basic_arithmetic", dict(
        config, operators=operators, allow_parentheses=False, allow_negation=False
    )


# name -> (reasoning_gym dataset name, config kwargs). Base greedy accuracies of SmolLM2-135M-Instruct
# (reward.py, response_length 64-96) are in examples/gsm8k_smollm2/README.md.
RG_PRESETS: dict[str, tuple[str, dict]] = {
    "add_2_d1to2": _arithmetic((2, 2), (1, 2), ("+",)),  # a + b, 1-2 digits: the recipe's task
    "add_3_d1": _arithmetic((3, 3), (1, 1), ("+",)),
    "add_sub_2_d2": _arithmetic((2, 2), (2, 2), ("+", "-")),
    "add_sub_2to3_d1to2": _arithmetic((2, 3), (1, 2), ("+", "-")),
    "mul_d1to2": _arithmetic((2, 2), (1, 2), ("*",)),
    "chain_sum_2to3_d1to2": ("chain_sum", dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2)),
    "chain_sum_3to4_d1to2": ("chain_sum", dict(min_terms=3, max_terms=4, min_digits=1, max_digits=2)),
    "leg_counting_2to3": ("leg_counting", dict(min_animals=2, max_animals=3, max_instances=5)),
    "gsm_symbolic": ("gsm_symbolic", {}),
}
DEFAULT_RG_PRESET = "add_2_d1to2"


def load_gsm8k_module():
    """``examples/data_preprocess/gsm8k.py`` as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess", GSM8K_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def gsm8k_rows(input_dir: str | Path) -> dict[str, list[dict]]:
    """``{"train", "test", "test200"}`` rows of GSM8K in verl's schema (test200 = first 200 test rows)."""
    gsm8k = load_gsm8k_module()
    input_dir = Path(input_dir).expanduser()
    rows = {}
    for split in gsm8k.SPLITS:
        source = input_dir / f"{split}.jsonl"
        if not source.is_file():
            raise FileNotFoundError(f"GSM8K {split} split not found: {source}")
        rows[split] = [gsm8k.make_row(ex, split, i) for i, ex in enumerate(gsm8k.read_jsonl(source))]
    rows["test200"] = rows["test"][:GSM8K_TEST_SUBSET]
    return rows


def rg_row(name: str, entry: dict, split: str, index: int) -> dict:
    """One verl-schema row from a reasoning-gym entry ``{"question", "answer", "metadata"}``."""
    question = entry["question"].strip()
    return {
        "data_source": f"reasoning_gym/{name}",
        "prompt": [{"role": "user", "content": f"{question} {RG_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "answer": str(entry["answer"]),
            "metadata": json.dumps(entry.get("metadata", {}), sort_keys=True, default=str),
        },
    }


def _distinct_entries(name: str, config: dict, seed: int, count: int, exclude: set[str]) -> list[dict]:
    """The first ``count`` entries of the generator with distinct questions not in ``exclude``."""
    import reasoning_gym

    pool = max(4 * count, 1000)
    dataset = reasoning_gym.create_dataset(name, size=pool, seed=seed, **config)
    seen, out = set(exclude), []
    for i in range(pool):
        entry = dataset[i]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        out.append(entry)
        if len(out) == count:
            break
    return out  # fewer than count when the task has fewer distinct problems


def rg_rows(
    preset: str, train_size: int = RG_TRAIN_SIZE, test_size: int = RG_TEST_SIZE
) -> dict[str, list[dict]]:
    """``{"train", "test200"}`` rows of a reasoning-gym preset; train and test share no question."""
    if preset not in RG_PRESETS:
        raise ValueError(f"unknown reasoning-gym preset {preset!r}; choose one of {sorted(RG_PRESETS)}")
    name, config = RG_PRESETS[preset]
    test = _distinct_entries(name, config, TEST_SEED, test_size, set())
    if len(test) < test_size:
        raise ValueError(f"{preset}: only {len(test)} distinct test questions (wanted {test_size})")
    train = _distinct_entries(name, config, TRAIN_SEED, train_size, {e["question"] for e in test})
    return {
        "train": [rg_row(name, e, "train", i) for i, e in enumerate(train)],
        "test200": [rg_row(name, e, "test", i) for i, e in enumerate(test)],
    }


def prepare(
    output_dir: str | Path,
    gsm8k_dir: str | Path = DEFAULT_GSM8K_DIR,
    rg_presets: tuple[str, ...] = (DEFAULT_RG_PRESET,),
    rg_train_size: int = RG_TRAIN_SIZE,
    skip_gsm8k: bool = False,
) -> dict[str, Path]:
    """Write every parquet; returns ``{"<task>/<split>": path}``."""
    output_dir = Path(output_dir).expanduser()
    written = {}
    if not skip_gsm8k:
        for split, rows in gsm8k_rows(gsm8k_dir).items():
            written[f"gsm8k/{split}"] = _write(rows, output_dir / "gsm8k" / f"{split}.parquet")
    for preset in rg_presets:
        for split, rows in rg_rows(preset, rg_train_size).items():
            written[f"{preset}/{split}"] = _write(rows, output_dir / preset / f"{split}.parquet")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR)
    parser.add_argument(
        "--gsm8k_dir",
        default=DEFAULT_GSM8K_DIR,
        help="folder holding GSM8K's train.jsonl and test.jsonl, from github.com/openai/grade-school-math "
        "(grade_school_math/data) (default: %(default)s)",
    )
    parser.add_argument(
        "--rg_preset",
        action="append",
        choices=sorted(RG_PRESETS),
        help=f"reasoning-gym preset(s) to write (repeatable; default {DEFAULT_RG_PRESET})",
    )
    parser.add_argument("--rg_train_size", type=int, default=RG_TRAIN_SIZE)
    parser.add_argument("--skip_gsm8k", action="store_true")
    args = parser.parse_args(argv)
    presets = tuple(args.rg_preset or (DEFAULT_RG_PRESET,))
    for key, path in prepare(
        args.output_dir, args.gsm8k_dir, presets, args.rg_train_size, args.skip_gsm8k
    ).items():
        import pyarrow.parquet as pq

        print(f"{key}: {path} ({pq.read_metadata(path).num_rows} rows)")


if __name__ == "__main__":
    main()
