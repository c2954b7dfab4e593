"""Read a split of a dataset from local files, the way ``datasets.load_dataset(folder)`` finds it, without
the ``datasets`` library or a network (the data-preparation scripts of ``examples/data_preprocess/``).

A split ``S`` of a folder is, the first that exists:

- ``S.parquet``, ``S.jsonl`` or ``S.json`` in the folder;
- Hugging Face's layout of a downloaded dataset repository: ``data/S-*.parquet`` or ``S-*.parquet`` (its
  shards, in name order; ``data/S-00000-of-00001.parquet`` for a one-file split);
- a folder ``S/`` of one JSON object a file, possibly in subfolders (Hendrycks' MATH archive:
  ``MATH/train/algebra/1.json``), in path order.

Rows come back as plain dicts and lists (parquet structs as dicts, image columns as
``{"bytes": ..., "path": ...}``).
"""

from __future__ import annotations

import json
from pathlib import Path

SUFFIXES = (".parquet", ".jsonl", ".json")


def read_rows(path: str | Path) -> list[dict]:
    """The rows of one ``.parquet``, ``.jsonl`` (an object a line) or ``.json`` file (a list of objects,
    one object, or an object a line)."""
    path = Path(path).expanduser()
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # JSON lines under a .json name
        if isinstance(data, list):
            return data
        if isinstance(data, dict):
            return [data]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def split_files(folder: str | Path, split: str) -> list[Path]:
    """The files of ``split`` in ``folder`` (module docstring); empty when it has none."""
    folder = Path(folder).expanduser()
    for suffix in SUFFIXES:
        if (folder / f"{split}{suffix}").is_file():
            return [folder / f"{split}{suffix}"]
    for where in (folder / "data", folder):
        shards = sorted(where.glob(f"{split}-*.parquet"))
        if shards:
            return shards
    if (folder / split).is_dir():
        return sorted(p for p in (folder / split).rglob("*.json") if p.is_file())
    return []


def read_split(folder: str | Path, split: str) -> list[dict]:
    """The rows of ``split`` in ``folder``; ``FileNotFoundError`` naming what was looked for."""
    files = split_files(folder, split)
    if not files:
        raise FileNotFoundError(
            f"no {split!r} split in {folder}: looked for {split}.parquet/.jsonl/.json, "
            f"data/{split}-*.parquet, {split}-*.parquet and a {split}/ folder of .json files"
        )
    return [row for file in files for row in read_rows(file)]


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write ``rows`` as a parquet file (its folder created); returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def add_folder_args(
    parser, input_default: str, output_default: str, input_help: str, output_help: str
) -> None:
    """verl's data-preparation flags on ``parser``: the input as ``--local_dataset_path`` / ``--input_dir``
    (``args.input_dir``), the output as ``--local_save_dir`` / ``--local_dir`` / ``--output_dir``
    (``args.output_dir``), each help followed by its default."""
    parser.add_argument(
        "--local_dataset_path",
        "--input_dir",
        dest="input_dir",
        default=input_default,
        help=f"{input_help} (default: %(default)s)",
    )
    parser.add_argument(
        "--local_save_dir",
        "--local_dir",
        "--output_dir",
        dest="output_dir",
        default=output_default,
        help=f"{output_help} (default: %(default)s)",
    )
