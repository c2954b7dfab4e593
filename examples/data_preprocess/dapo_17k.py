"""Prepare DAPO-Math-17k (and AIME 2024 for validation) as verl's RL parquet rows, from local files.

DAPO's files are published in verl's row layout already, and verl's DAPO recipes train on them as they
are (``TRAIN_FILE=dapo-math-17k.parquet``, ``TEST_FILE=aime-2024.parquet``):

- ``data_source``: ``"math_dapo"`` (scored by ``math_dapo``: the response's last ``Answer: ...`` line
  against the ground truth; given to rows that have none);
- ``prompt``: one user message, DAPO's ("Solve the following math problem step by step. The last line of
  your response should be of the form Answer: $Answer ...");
- ``ability``: ``"MATH"``; ``reward_model``: ``{"ground_truth": ..., "style": "rule-lighteval/MATH_v2"}``;
  ``extra_info``: ``{"index": ...}``.

This script checks every row has that layout, and writes ``train.parquet`` (and ``test.parquet`` from
``--aime_path``). Options: ``--dedup`` keeps the first row of each distinct prompt (the published
DAPO-Math-17k parquet repeats its problems many times over); ``--multiturn_w_tool`` adds what verl's
``examples/data_preprocess/dapo_multiturn_w_tool.py`` adds for ReTool-style runs with the code
interpreter (``extra_info.need_tools_kwargs`` and ``extra_info.tools_kwargs.code_interpreter.create_kwargs
.ground_truth``).

Input (``--local_dataset_path``, verl's flag): ``dapo-math-17k.parquet`` from
https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k (``data/dapo-math-17k.parquet``), or that
repository downloaded whole; ``--aime_path``: ``aime-2024.parquet`` of
https://huggingface.co/datasets/BytedTsinghua-SIA/AIME-2024 (``data/aime-2024.parquet``) or its folder.
See this folder's README.md::

    python examples/data_preprocess/dapo_17k.py --local_dataset_path ~/data/dapo-math-17k.parquet \\
        --aime_path ~/data/aime-2024.parquet --dedup --local_save_dir ~/data/dapo

verl's ``--local_dir`` (output) is accepted too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridflow.utils.local_data import read_rows, read_split, write_rows

DATA_SOURCE = "math_dapo"
TOOL_NAME = "code_interpreter"  # the function name of verl's ReTool code tool


def read(path: str | Path, name: str) -> list[dict]:
    """The rows of ``path`` when it is a file; in a folder, of ``name`` (or ``data/<name>``), else of its
    train split."""
    path = Path(path).expanduser()
    if path.is_file():
        return read_rows(path)
    for candidate in (path / name, path / "data" / name):
        if candidate.is_file():
            return read_rows(candidate)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    return read_split(path, "train")


def check_row(row: dict, where: str) -> dict:
    """``row`` with ``data_source`` filled in; ValueError when it is not in DAPO's (verl's) layout."""
    prompt = row.get("prompt")
    if not (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    ):
        raise ValueError(
            f"{where}: 'prompt' must be a list of {{role, content}} messages, got {prompt!r:.200}"
        )
    reward_model = row.get("reward_model")
    if not (isinstance(reward_model, dict) and reward_model.get("ground_truth") not in (None, "")):
        raise ValueError(f"{where}: no reward_model.ground_truth")
    return {**row, "data_source": row.get("data_source") or DATA_SOURCE}


def with_tool_kwargs(row: dict) -> dict:
    """verl's ``dapo_multiturn_w_tool.py``: the code interpreter gets the ground truth at ``create``."""
    extra_info = dict(row.get("extra_info") or {})
    extra_info["need_tools_kwargs"] = True
    extra_info["tools_kwargs"] = {
        TOOL_NAME: {"create_kwargs": {"ground_truth": row["reward_model"]["ground_truth"]}}
    }
    return {**row, "extra_info": extra_info}


def prepare(rows: list[dict], what: str, dedup: bool = False, multiturn_w_tool: bool = False) -> list[dict]:
    rows = [check_row(row, f"{what} row {i}") for i, row in enumerate(rows)]
    if dedup:
        seen: set[str] = set()
        unique = []
        for row in rows:
            key = json.dumps(row["prompt"], sort_keys=True)
            if key not in seen:
                seen.add(key)
                unique.append(row)
        rows = unique
    return [with_tool_kwargs(row) for row in rows] if multiturn_w_tool else rows


def convert(
    train_path: str | Path,
    output_dir: str | Path,
    aime_path: str | Path | None = None,
    dedup: bool = False,
    multiturn_w_tool: bool = False,
) -> dict[str, Path]:
    """Write ``train.parquet`` (and ``test.parquet`` from ``aime_path``); returns ``{split: path}``."""
    output_dir = Path(output_dir).expanduser()
    sources = {"train": read(train_path, "dapo-math-17k.parquet")}  # all read before any is written
    if aime_path is not None:
        sources["test"] = read(aime_path, "aime-2024.parquet")
    return {
        split: write_rows(
            prepare(rows, split, dedup=dedup and split == "train", multiturn_w_tool=multiturn_w_tool),
            output_dir / f"{split}.parquet",
        )
        for split, rows in sources.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--local_dataset_path",
        "--input",
        dest="input",
        default="~/data/dapo-math-17k.parquet",
        help="dapo-math-17k.parquet, or the dataset's folder (default: %(default)s)",
    )
    parser.add_argument("--aime_path", default=None, help="aime-2024.parquet (or its folder): test.parquet")
    parser.add_argument(
        "--local_save_dir",
        "--local_dir",
        "--output_dir",
        dest="output_dir",
        default="~/data/dapo",
        help="where train.parquet (and test.parquet) go (default: %(default)s)",
    )
    parser.add_argument("--dedup", action="store_true", help="keep the first row of each distinct prompt")
    parser.add_argument(
        "--multiturn_w_tool", action="store_true", help="add verl's code_interpreter tools_kwargs"
    )
    args = parser.parse_args(argv)
    written = convert(args.input, args.output_dir, args.aime_path, args.dedup, args.multiturn_w_tool)
    for split, path in written.items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
