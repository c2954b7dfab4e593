"""Convert Geometry3K (``hiyouga/geometry3k``, with its diagrams) to verl's RL parquet rows, from local files.

The rows verl's ``examples/data_preprocess/geo3k.py`` writes:

- ``data_source``: ``"hiyouga/geometry3k"`` (scored by the ``geo3k`` scorer: 0.9 for the right
  ``\\boxed{}`` answer, 0.1 for the ``<think>...</think>...\\boxed{}`` format);
- ``prompt``: one user message, the problem (its ``<image>`` placeholder kept), a space and the
  instruction to think inside ``<think> </think>`` and put the final answer in ``\\boxed{}``;
- ``images``: the row's images as they are (``{"bytes": ..., "path": ...}``, read by the RL dataset);
- ``ability``: ``"math"``; ``reward_model``: ``{"style": "rule", "ground_truth": answer}``;
  ``extra_info``: ``{"split", "index", "answer", "question"}``.

Input (``--local_dataset_path``, verl's flag): the dataset repository downloaded from
https://huggingface.co/datasets/hiyouga/geometry3k (``data/train-*.parquet``, ``data/test-*.parquet``:
columns ``images``, ``problem``, ``answer``), or a folder of ``train`` and ``test`` parquet/jsonl files in
that layout; see this folder's README.md::

    python examples/data_preprocess/geo3k.py --local_dataset_path ~/data/geometry3k \\
        --local_save_dir ~/data/geo3k

verl's ``--local_dir`` (output) is accepted too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.utils.local_data import add_folder_args, read_split, write_rows

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (
    r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
    r"answer. "
    r"The reasoning process MUST BE enclosed within <think> </think> tags. "
    r"The final answer MUST BE put in \boxed{}."
)
SPLITS = ("train", "test")


def make_row(example: dict, split: str, index: int) -> dict:
    """One verl row from a Geometry3K ``{"images", "problem", "answer"}`` record (other fields kept)."""
    example = dict(example)
    problem = example.pop("problem")
    answer = example.pop("answer")
    images = example.pop("images")
    return {
        **example,
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": problem},
    }


def convert(input_dir: str | Path, output_dir: str | Path) -> dict[str, Path]:
    """Write ``train.parquet`` and ``test.parquet`` to ``output_dir``; returns ``{split: path}``."""
    output_dir = Path(output_dir).expanduser()
    records = {split: read_split(input_dir, split) for split in SPLITS}  # all found before any is written
    return {
        split: write_rows(
            [make_row(r, split, i) for i, r in enumerate(rows)], output_dir / f"{split}.parquet"
        )
        for split, rows in records.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_folder_args(
        parser,
        "~/data/geometry3k",
        "~/data/geo3k",
        "folder with the train and test splits",
        "where train.parquet and test.parquet go, verl's default",
    )
    args = parser.parse_args(argv)
    for split, path in convert(args.input_dir, args.output_dir).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
