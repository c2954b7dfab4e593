"""Convert NQ / HotpotQA question files to verl's Search-R1 parquet rows, from local files.

The rows verl's ``examples/data_preprocess/preprocess_search_r1_dataset.py`` writes, for the search tool
(``SearchTool``) and the ``search_r1_like_qa_em`` scorer:

- ``data_source``: ``"searchR1_" + <the row's data_source>`` (``searchR1_nq``, ``searchR1_hotpotqa``, ...);
  ``--data_source`` gives it to rows that have none (FlashRAG's files);
- ``prompt``: verl's system message and Search-R1's instruction followed by the question;
- ``ability``: the row's, else ``"fact-reasoning"`` (Search-R1's);
- ``reward_model``: the row's when it has a ``ground_truth``, else
  ``{"style": "rule", "ground_truth": {"target": golden_answers}}``;
- ``extra_info``: ``index``, ``need_tools_kwargs: true``, ``question``, ``split`` and
  ``tools_kwargs.search.create_kwargs`` = ``{ground_truth, question, data_source}``;
- ``metadata``: the row's, else null.

Input: ``<input_dir>/<split>.parquet`` or ``<split>.jsonl`` for each of ``--splits``; each row needs
``question`` and either ``golden_answers`` (a list of strings) or ``reward_model.ground_truth``. Both
Search-R1's own files (``PeterJinGo/nq_hotpotqa_train`` on Hugging Face: ``train.parquet`` and
``test.parquet``, the files verl's script downloads) and FlashRAG's (``RUC-NLPIR/FlashRAG_datasets``:
``nq/train.jsonl``, ``hotpotqa/dev.jsonl``, ...) fit; see this folder's README.md::

    python examples/data_preprocess/search_r1.py --input_dir ~/data/nq_hotpotqa_train \\
        --output_dir ~/data/searchR1
    python examples/data_preprocess/search_r1.py --input_dir ~/data/flashrag/hotpotqa --splits train dev \\
        --data_source hotpotqa --output_dir ~/data/searchR1_hotpotqa

verl's ``--local_dir`` (output) is accepted too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hybridflow.utils.local_data import add_folder_args

DEFAULT_SYSTEM_CONTENT = "You are a helpful and harmless assistant."
DEFAULT_USER_CONTENT_PREFIX = (  # Search-R1's instruction, as verl's script has it
    "Answer the given question. You must conduct reasoning inside <think> and </think> "
    "first every time you get new information. After reasoning, if you find you lack "
    "some knowledge, you can call a search engine by <tool_call> query </tool_call> "
    "and it will return the top searched results between <tool_response> and "
    "</tool_response>. You can search as many times as your want. If you find no "
    "further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: "
)
DATA_SOURCE_PREFIX = "searchR1_"
DEFAULT_ABILITY = "fact-reasoning"
TOOL_NAME = "search"  # the function name of the search tool's schema


def make_row(record: dict[str, Any], split: str, index: int, data_source: str | None = None) -> dict:
    """One verl row from a ``{question, golden_answers | reward_model, [data_source]}`` record."""
    question = record.get("question")
    if not isinstance(question, str) or not question:
        raise ValueError(f"{split} row {index}: no 'question'")
    source = record.get("data_source") or data_source
    if not source:
        raise ValueError(f"{split} row {index}: no 'data_source'; give one with --data_source (e.g. nq)")
    source = source if str(source).startswith(DATA_SOURCE_PREFIX) else DATA_SOURCE_PREFIX + str(source)
    reward_model = record.get("reward_model")
    if not (isinstance(reward_model, dict) and "ground_truth" in reward_model):
        answers = record.get("golden_answers")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not answers:
            raise ValueError(f"{split} row {index}: needs 'golden_answers' or 'reward_model.ground_truth'")
        reward_model = {"style": "rule", "ground_truth": {"target": [str(a) for a in answers]}}
    ground_truth = reward_model["ground_truth"]
    create_kwargs = {"ground_truth": ground_truth, "question": question, "data_source": source}
    return {
        "data_source": source,
        "prompt": [
            {"role": "system", "content": DEFAULT_SYSTEM_CONTENT},
            {"role": "user", "content": DEFAULT_USER_CONTENT_PREFIX.rstrip("\n") + question},
        ],
        "ability": record.get("ability") or DEFAULT_ABILITY,
        "reward_model": reward_model,
        "extra_info": {
            "index": index,
            "need_tools_kwargs": True,
            "question": question,
            "split": split,
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": create_kwargs}},
        },
        "metadata": record.get("metadata"),
    }


def read_records(path: Path) -> list[dict]:
    """The rows of a ``.parquet`` or ``.jsonl`` file as dicts (lists, not arrays)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def find_split(input_dir: Path, split: str) -> Path:
    for suffix in (".parquet", ".jsonl"):
        if (input_dir / f"{split}{suffix}").is_file():
            return input_dir / f"{split}{suffix}"
    raise FileNotFoundError(f"no {split}.parquet or {split}.jsonl in {input_dir}")


def convert(
    input_dir: str | Path, output_dir: str | Path, splits=("train", "test"), data_source: str | None = None
) -> dict[str, Path]:
    """Write ``<split>.parquet`` to ``output_dir`` for each split; returns ``{split: path}``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    input_dir, output_dir = Path(input_dir).expanduser(), Path(output_dir).expanduser()
    sources = {split: find_split(input_dir, split) for split in splits}  # all found before any is written
    output_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, source in sources.items():
        rows = [make_row(r, split, i, data_source) for i, r in enumerate(read_records(source))]
        written[split] = output_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), written[split])
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_folder_args(
        parser,
        "~/data/nq_hotpotqa_train",
        "~/data/searchR1_processed_direct",
        "folder with <split>.parquet or <split>.jsonl",
        "where <split>.parquet go",
    )
    parser.add_argument("--splits", nargs="+", default=["train", "test"])
    parser.add_argument("--data_source", default=None, help="for rows without one: nq, hotpotqa, ...")
    args = parser.parse_args(argv)
    for split, path in convert(args.input_dir, args.output_dir, args.splits, args.data_source).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
