"""examples/data_preprocess/search_r1.py: verl's Search-R1 rows from Search-R1's parquet (data_source in
the rows) and from FlashRAG-style jsonl (``--data_source``), scored by ``search_r1_like_qa_em``."""

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.utils.reward_score import default_compute_score

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data_preprocess" / "search_r1.py"
# a row of PeterJinGo/nq_hotpotqa_train as its parquet holds it (Search-R1's own fields)
SEARCH_R1_ROW = {
    "id": "train_0",
    "question": "total number of death row inmates in the us",
    "golden_answers": ["2,718"],
    "data_source": "nq",
    "prompt": [{"role": "user", "content": "Search-R1's own prompt"}],
    "ability": "fact-reasoning",
    "reward_model": {"ground_truth": {"target": ["2,718"]}, "style": "rule"},
    "extra_info": {"index": 0, "split": "train"},
    "metadata": None,
}


@pytest.fixture(scope="module")
def search_r1():
    spec = importlib.util.spec_from_file_location("search_r1_preprocess", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_search_r1_parquet_becomes_verls_rows(search_r1, tmp_path):
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    for split in ("train", "test"):
        pq.write_table(
            pa.Table.from_pylist([SEARCH_R1_ROW, {**SEARCH_R1_ROW, "data_source": "hotpotqa"}]),
            source / f"{split}.parquet",
        )
    search_r1.main(["--input_dir", str(source), "--local_dir", str(out)])
    rows = pq.read_table(out / "train.parquet").to_pylist()
    row = rows[0]
    assert [r["data_source"] for r in rows] == ["searchR1_nq", "searchR1_hotpotqa"]
    question = SEARCH_R1_ROW["question"]
    assert row["prompt"] == [
        {"role": "system", "content": "You are a helpful and harmless assistant."},
        {"role": "user", "content": search_r1.DEFAULT_USER_CONTENT_PREFIX + question},
    ]
    assert row["prompt"][1]["content"].startswith("Answer the given question. You must conduct reasoning")
    assert row["prompt"][1]["content"].endswith("<answer> Beijing </answer>. Question: " + question)
    assert row["ability"] == "fact-reasoning" and row["metadata"] is None
    assert row["reward_model"] == {"ground_truth": {"target": ["2,718"]}, "style": "rule"}
    assert row["extra_info"] == {
        "index": 0,
        "need_tools_kwargs": True,
        "question": question,
        "split": "train",
        "tools_kwargs": {
            "search": {
                "create_kwargs": {
                    "ground_truth": {"target": ["2,718"]},
                    "question": question,
                    "data_source": "searchR1_nq",
                }
            }
        },
    }
    assert pq.read_table(out / "test.parquet").to_pylist()[1]["extra_info"]["split"] == "test"
    # the scorer verl dispatches searchR1_* to reads these rows' ground truth
    gt = row["reward_model"]["ground_truth"]
    assert default_compute_score(row["data_source"], "<answer> 2718 </answer>", gt) == 1.0
    assert default_compute_score(row["data_source"], "<answer> 12 </answer>", gt) == 0.0


def test_flashrag_jsonl_with_a_data_source_flag(search_r1, tmp_path):
    source, out = tmp_path / "hotpotqa", tmp_path / "out"
    source.mkdir()
    record = {"id": "1", "question": "Which city is the capital of France?", "golden_answers": ["Paris"]}
    for split in ("train", "dev"):
        (source / f"{split}.jsonl").write_text(json.dumps(record) + "\n\n")
    with pytest.raises(ValueError, match="--data_source"):
        search_r1.convert(source, out, ["train"])
    written = search_r1.convert(source, out, ["train", "dev"], data_source="hotpotqa")
    row = pq.read_table(written["dev"]).to_pylist()[0]
    assert row["data_source"] == "searchR1_hotpotqa" and row["ability"] == "fact-reasoning"
    assert row["reward_model"] == {"style": "rule", "ground_truth": {"target": ["Paris"]}}
    create_kwargs = row["extra_info"]["tools_kwargs"]["search"]["create_kwargs"]
    assert (
        create_kwargs["ground_truth"] == {"target": ["Paris"]}
        and create_kwargs["data_source"] == row["data_source"]
    )
    # a missing split is named before anything is written
    with pytest.raises(FileNotFoundError, match="no test.parquet or test.jsonl"):
        search_r1.convert(source, tmp_path / "none", ["train", "test"], data_source="hotpotqa")
    assert not (tmp_path / "none").exists()
