"""examples/data_preprocess/gsm8k.py: verl's GSM8K rows, on a tiny file and on the real local copy."""

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hybridflow.utils.reward_score import default_compute_score

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data_preprocess" / "gsm8k.py"
REAL_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="module")
def gsm8k():
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


RECORD = {
    "question": "Tom has 1,000 apples and buys 234. How many?",
    "answer": "1000+234=<<1000+234=1234>>\n#### 1,234",
}


def test_extract_solution(gsm8k):
    assert gsm8k.extract_solution(RECORD["answer"]) == "1234"
    assert gsm8k.extract_solution("#### -3.5") == "-3.5"
    with pytest.raises(ValueError, match="no '#### N'"):
        gsm8k.extract_solution("just 5")


def test_make_row_matches_verl(gsm8k):
    row = gsm8k.make_row(RECORD, "train", 4)
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    assert row == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": RECORD["question"] + " " + instruction}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1234"},
        "extra_info": {
            "split": "train",
            "index": 4,
            "answer": RECORD["answer"],
            "question": RECORD["question"],
        },
    }


def test_cli_accepts_verl_flags(gsm8k, tmp_path, capsys):
    source = tmp_path / "in"
    source.mkdir()
    write_jsonl(source / "train.jsonl", [RECORD, RECORD])
    write_jsonl(source / "test.jsonl", [RECORD])
    gsm8k.main(["--local_dataset_path", str(source), "--local_save_dir", str(tmp_path / "out")])
    assert "train.parquet" in capsys.readouterr().out
    assert pq.read_table(tmp_path / "out" / "train.parquet").num_rows == 2
    gsm8k.main(["--input_dir", str(source), "--local_dir", str(tmp_path / "out2")])
    assert pq.read_table(tmp_path / "out2" / "test.parquet").num_rows == 1


def test_missing_split_is_a_clear_error(gsm8k, tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [RECORD])
    with pytest.raises(FileNotFoundError, match="test split not found"):
        gsm8k.convert(tmp_path, tmp_path / "out")


@pytest.mark.skipif(not (REAL_DATA / "train.jsonl").is_file(), reason="no local GSM8K copy")
def test_convert_real_gsm8k(gsm8k, tmp_path):
    written = gsm8k.convert(REAL_DATA, tmp_path)
    train = pq.read_table(written["train"]).to_pylist()
    test = pq.read_table(written["test"]).to_pylist()
    assert (len(train), len(test)) == (7473, 1319)
    assert train[0]["prompt"][0]["content"].startswith("Natalia sold clips to 48 of her friends")
    assert train[0]["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert test[-1]["extra_info"]["split"] == "test" and test[-1]["extra_info"]["index"] == 1318
    assert all("," not in r["reward_model"]["ground_truth"] for r in train + test)
    # the reference solutions themselves score 1 under the strict gsm8k scorer
    for r in train[:500] + test:
        gt = r["reward_model"]["ground_truth"]
        assert default_compute_score("openai/gsm8k", r["extra_info"]["answer"], gt) == 1.0, r["extra_info"][
            "index"
        ]
