"""examples/gsm8k_smollm2: prepare_data.py's verl-schema rows and reward.py's scoring (no model)."""

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hybridflow.utils.reward_score import default_compute_score
from hybridflow.workers.reward_manager.custom import load_custom_reward_function

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "gsm8k_smollm2"
ROW_KEYS = {"data_source", "prompt", "ability", "reward_model", "extra_info"}


def _load(name):
    spec = importlib.util.spec_from_file_location(f"gsm8k_smollm2_{name}", RECIPE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prep():
    return _load("prepare_data")


@pytest.fixture(scope="module")
def reward():
    return load_custom_reward_function(str(RECIPE / "reward.py"), "compute_score")


def _check_row(row, data_source, split):
    assert set(row) == ROW_KEYS
    assert row["data_source"] == data_source
    assert isinstance(row["prompt"], list) and len(row["prompt"]) == 1
    assert row["prompt"][0]["role"] == "user" and "####" in row["prompt"][0]["content"]
    assert row["ability"] == "math"
    assert row["reward_model"]["style"] == "rule"
    assert isinstance(row["reward_model"]["ground_truth"], str) and row["reward_model"]["ground_truth"]
    assert row["extra_info"]["split"] == split and isinstance(row["extra_info"]["index"], int)


def test_gsm8k_rows_and_fixed_subset(prep, tmp_path):
    source = tmp_path / "gsm8k"
    source.mkdir()
    records = [
        {"question": f"Q{i}: 1 + {i}?", "answer": f"1+{i}=<<1+{i}={1 + i}>>\n#### {1 + i:,}"}
        for i in range(1200)
    ]
    records[5]["answer"] = "#### 1,234"
    for split in ("train", "test"):
        (source / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = prep.gsm8k_rows(source)
    assert len(rows["train"]) == len(rows["test"]) == 1200
    assert rows["test200"] == rows["test"][:200]  # the first 200 test questions, in file order
    for split in ("train", "test", "test200"):
        _check_row(rows[split][0], "openai/gsm8k", "train" if split == "train" else "test")
    assert rows["test"][5]["reward_model"]["ground_truth"] == "1234"
    assert rows["test"][5]["prompt"][0]["content"].startswith("Q5: 1 + 5?")


def test_rg_rows_schema_disjoint_and_deterministic(prep):
    rows = prep.rg_rows(prep.DEFAULT_RG_PRESET, train_size=100)
    assert len(rows["test200"]) == 200 and len(rows["train"]) == 100
    name, config = prep.RG_PRESETS[prep.DEFAULT_RG_PRESET]
    for split, split_rows in (("train", rows["train"]), ("test", rows["test200"])):
        for row in split_rows[:5]:
            _check_row(row, f"reasoning_gym/{name}", split)
            assert row["extra_info"]["answer"] == row["reward_model"]["ground_truth"]
            json.loads(row["extra_info"]["metadata"])
    questions = lambda split: [r["extra_info"]["question"] for r in rows[split]]  # noqa: E731
    assert len(set(questions("test200"))) == 200
    assert not set(questions("train")) & set(questions("test200"))
    again = prep._distinct_entries(name, config, prep.TEST_SEED, 5, set())  # fixed seed: same test set
    assert [e["question"] for e in again] == questions("test200")[:5]
    with pytest.raises(ValueError, match="unknown reasoning-gym preset"):
        prep.rg_rows("nope")


def test_prepare_writes_parquet(prep, tmp_path):
    written = prep.prepare(tmp_path, rg_train_size=10, skip_gsm8k=True)
    table = pq.read_table(written[f"{prep.DEFAULT_RG_PRESET}/test200"])
    assert table.num_rows == 200 and ROW_KEYS <= set(table.column_names)
    row = table.slice(0, 1).to_pylist()[0]
    assert row["prompt"][0]["role"] == "user" and row["reward_model"]["ground_truth"]


RG = "reasoning_gym/basic_arithmetic"


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("12 + 30 = 42\n#### 42", "42", 1.0),
        ("#### 1,234.", "1234", 1.0),
        ("The answer is -7.", "-7", 1.0),
        ("so the result is \\boxed{15}", "15", 1.0),
        ("To calculate 6 + 9 we add them: 6 + 9 = 15.", "15", 1.0),  # last number
        ("#### 15\nThe answer is 16.", "15", 1.0),  # '####' wins over later numbers
        ("6 + 9 = 14", "15", 0.0),
        ("#### 14", "15", 0.0),
        ("I do not know.", "15", 0.0),  # malformed: no number
        ("", "15", 0.0),
        ("####", "15", 0.0),
        ("#### 3.0", "3", 1.0),  # numeric comparison
    ],
)
def test_reward_rg(reward, response, truth, expected):
    assert reward(RG, response, truth, None) == expected


def test_reward_strict_and_gsm8k(reward):
    assert reward(RG, "6 + 9 = 15", "15", None, strict=True) == 0.0
    assert reward(RG, "#### 15", "15", None, strict=True) == 1.0
    # openai/gsm8k rows: the built-in scorer, strict by default, flexible on request
    for response in ("So she has 72 apples.", "#### 72", "#### 71", "no idea"):
        assert reward("openai/gsm8k", response, "72") == default_compute_score("openai/gsm8k", response, "72")
    assert reward("openai/gsm8k", "So she has 72 apples.", "72", gsm8k_method="flexible") == 1.0
    assert reward("openai/gsm8k", "So she has 72 apples.", "72") == 0.0
