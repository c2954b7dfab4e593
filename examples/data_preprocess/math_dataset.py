"""Convert MATH (Hendrycks et al.) to verl's RL parquet rows, from local files.

The rows verl's ``examples/data_preprocess/math_dataset.py`` writes from
``DigitalLearningGmbH/MATH-lighteval`` (the mirror verl reads since ``lighteval/MATH`` left the Hub):

- ``data_source``: ``"DigitalLearningGmbH/MATH-lighteval"`` (scored by the ``math`` scorer: the last
  ``\\boxed{}`` of the response against the ground truth);
- ``prompt``: one user message, the problem, a space and
  ``Let's think step by step and output the final answer within \\boxed{}.``;
- ``ability``: ``"math"``; ``reward_model``: ``{"style": "rule", "ground_truth": <the last \\boxed{} of the
  solution, unboxed>}``; ``extra_info``: ``{"split", "index"}``;
- the input's other columns (``level``, ``type``) are kept, as verl's ``datasets.map`` keeps them.

Input (``--local_dataset_path``, verl's flag): a folder with the ``train`` and ``test`` splits, either the
dataset repository downloaded from https://huggingface.co/datasets/DigitalLearningGmbH/MATH-lighteval
(``data/train-*.parquet``, ``data/test-*.parquet``) or Hendrycks' archive unpacked (``MATH/`` with
``train/<subject>/<n>.json`` and ``test/...``); see this folder's README.md::

    python examples/data_preprocess/math_dataset.py --local_dataset_path ~/data/MATH-lighteval \\
        --local_save_dir ~/data/math

Writes ``train.parquet``, ``test.parquet`` and, as verl does, ``train_example.json`` and
``test_example.json`` (the first row of each). verl's ``--local_dir`` (output) is accepted too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridflow.utils.local_data import add_folder_args, read_split, write_rows
from hybridflow.utils.reward_score.math_reward import last_boxed_only_string, remove_boxed

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SPLITS = ("train", "test")


def extract_solution(solution_str: str) -> str:
    """The last ``\\boxed{...}`` of a MATH solution, unboxed (verl's)."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        raise ValueError(f"MATH solution has no \\boxed{{}} answer: {solution_str[-200:]!r}")
    return remove_boxed(boxed)


def make_row(example: dict, split: str, index: int) -> dict:
    """One verl row from a MATH ``{"problem", "solution", ...}`` record (other fields kept)."""
    example = dict(example)
    question = example.pop("problem")
    answer = example.pop("solution")
    return {
        **example,
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_solution(answer)},
        "extra_info": {"split": split, "index": index},
    }


def convert(input_dir: str | Path, output_dir: str | Path) -> dict[str, Path]:
    """Write ``<split>.parquet`` and ``<split>_example.json`` for train and test; ``{split: parquet}``."""
    output_dir = Path(output_dir).expanduser()
    records = {split: read_split(input_dir, split) for split in SPLITS}  # all found before any is written
    written = {}
    for split, examples in records.items():
        rows = [make_row(example, split, i) for i, example in enumerate(examples)]
        written[split] = write_rows(rows, output_dir / f"{split}.parquet")
        (output_dir / f"{split}_example.json").write_text(json.dumps(rows[0], indent=2))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_folder_args(
        parser,
        "~/data/MATH-lighteval",
        "~/data/math",
        "folder with the train and test splits",
        "where train.parquet and test.parquet go, verl's default",
    )
    args = parser.parse_args(argv)
    for split, path in convert(args.input_dir, args.output_dir).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
