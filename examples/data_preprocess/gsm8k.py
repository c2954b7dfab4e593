"""Convert GSM8K (jsonl with ``question`` and ``answer`` ending in ``#### N``) to verl's RL parquet schema.

Same rows as verl's ``examples/data_preprocess/gsm8k.py``: ``data_source="openai/gsm8k"``, the
question plus an instruction as one user message, ``ability="math"``,
``reward_model={"style": "rule", "ground_truth": N}`` (commas removed) and
``extra_info={"split", "index", "answer", "question"}``. Reads local files only:
``<input_dir>/train.jsonl`` and ``<input_dir>/test.jsonl``, GSM8K as OpenAI publishes it
(github.com/openai/grade-school-math, folder ``grade_school_math/data``; docs/models_and_data.md):

    python examples/data_preprocess/gsm8k.py --input_dir ~/data/gsm8k_jsonl --output_dir ~/data/gsm8k

verl's flags are accepted: ``--local_dataset_path`` (input), ``--local_save_dir``/``--local_dir`` (output).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from hybridflow.utils.local_data import add_folder_args

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
DEFAULT_INPUT_DIR = "~/data/gsm8k_jsonl"  # where docs/models_and_data.md downloads train.jsonl and test.jsonl

_SOLUTION = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(answer: str) -> str:
    """The number after ``#### `` with commas removed (``"... #### 1,234"`` → ``"1234"``)."""
    match = _SOLUTION.search(answer)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### N' final answer: {answer[-200:]!r}")
    return match.group(1).replace(",", "")


def make_row(example: dict, split: str, index: int) -> dict:
    """One verl-schema row from a GSM8K ``{"question", "answer"}`` record."""
    question, answer = example["question"], example["answer"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_solution(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def convert(input_dir: str | Path, output_dir: str | Path) -> dict[str, Path]:
    """Write ``train.parquet`` and ``test.parquet`` to ``output_dir``; returns ``{split: path}``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    input_dir, output_dir = Path(input_dir).expanduser(), Path(output_dir).expanduser()
    output_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split in SPLITS:
        source = input_dir / f"{split}.jsonl"
        if not source.is_file():
            raise FileNotFoundError(f"GSM8K {split} split not found: {source} (expected {split}.jsonl)")
        rows = [make_row(example, split, i) for i, example in enumerate(read_jsonl(source))]
        written[split] = output_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), written[split])
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_folder_args(
        parser,
        DEFAULT_INPUT_DIR,
        "~/data/gsm8k",
        "folder holding GSM8K's train.jsonl and test.jsonl, from github.com/openai/grade-school-math "
        "(grade_school_math/data)",
        "where train.parquet and test.parquet go",
    )
    args = parser.parse_args(argv)
    for split, path in convert(args.input_dir, args.output_dir).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
