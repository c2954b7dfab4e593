"""examples/data_preprocess/{math_dataset,dapo_17k,geo3k}.py: verl's rows from tiny local files in each
source's real layout (a Hugging Face dataset repository as downloaded, Hendrycks' MATH archive, DAPO's
parquet), and ``default_compute_score`` dispatching their ``data_source`` scores a right answer 1."""

import importlib.util
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.utils.reward_score import default_compute_score

FOLDER = Path(__file__).resolve().parents[2] / "examples" / "data_preprocess"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_preprocess", FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def read_parquet(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


# ------------------------------------------------------------------------------------------- MATH

MATH_ROWS = [  # DigitalLearningGmbH/MATH-lighteval's columns
    {
        "problem": "What is $\\frac{2}{4}$ in lowest terms?",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": "Divide both by 2: $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$.",
    },
    {
        "problem": "Compute $3 \\cdot 4$.",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": "First $\\boxed{7}$ is wrong; $3 \\cdot 4 = \\boxed{12}$.",
    },
]
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def test_math_lighteval_repository_becomes_verls_rows(tmp_path):
    math_dataset = load("math_dataset")
    for split in ("train", "test"):  # the repository's layout: data/<split>-00000-of-00001.parquet
        write_parquet(tmp_path / "MATH-lighteval" / "data" / f"{split}-00000-of-00001.parquet", MATH_ROWS)
    out = tmp_path / "math"
    math_dataset.main(
        ["--local_dataset_path", str(tmp_path / "MATH-lighteval"), "--local_save_dir", str(out)]
    )
    rows = read_parquet(out / "train.parquet")
    assert rows[0] == {  # verl's map: problem and solution popped, level and type kept
        "level": "Level 1",
        "type": "Prealgebra",
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": MATH_ROWS[0]["problem"] + " " + MATH_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
        "extra_info": {"split": "train", "index": 0},
    }
    assert rows[1]["reward_model"]["ground_truth"] == "12"  # the last \boxed{}
    test_rows = read_parquet(out / "test.parquet")
    assert [r["extra_info"] for r in test_rows] == [
        {"split": "test", "index": 0},
        {"split": "test", "index": 1},
    ]
    assert json.loads((out / "train_example.json").read_text()) == rows[0]
    truth = rows[0]["reward_model"]["ground_truth"]
    assert default_compute_score(rows[0]["data_source"], "So it is $\\boxed{\\frac12}$.", truth) == 1.0
    assert default_compute_score(rows[0]["data_source"], "So it is $\\boxed{2}$.", truth) == 0.0


def test_math_from_hendrycks_archive_folders(tmp_path):
    math_dataset = load("math_dataset")
    for split in ("train", "test"):  # MATH/<split>/<subject>/<n>.json
        for i, row in enumerate(MATH_ROWS):
            path = tmp_path / "MATH" / split / "prealgebra" / f"{i}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(row))
    written = math_dataset.convert(tmp_path / "MATH", tmp_path / "out")
    rows = read_parquet(written["test"])
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{2}", "12"]
    with pytest.raises(FileNotFoundError, match="no 'train' split"):
        math_dataset.convert(tmp_path / "nowhere", tmp_path / "out2")


# ------------------------------------------------------------------------------------------- DAPO

DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def dapo_row(problem: str, answer: str, index: str) -> dict:  # DAPO-Math-17k's row, as published
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PROMPT.format(problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def test_dapo_17k_rows_as_verl_reads_them(tmp_path):
    dapo = load("dapo_17k")
    train = [dapo_row("Find 30 + 4.", "34", "a1"), dapo_row("Find 2 * 5.", "10", "b2")]
    write_parquet(tmp_path / "DAPO-Math-17k" / "data" / "dapo-math-17k.parquet", train * 3)  # repeated
    write_parquet(tmp_path / "aime-2024.parquet", [dapo_row("AIME problem.", "204", "0")])
    out = tmp_path / "dapo"
    dapo.main(["--local_dataset_path", str(tmp_path / "DAPO-Math-17k"), "--local_save_dir", str(out)])
    assert read_parquet(out / "train.parquet") == train * 3  # as published: verl trains on it as it is
    assert not (out / "test.parquet").exists()

    argv = ["--local_dataset_path", str(tmp_path / "DAPO-Math-17k" / "data" / "dapo-math-17k.parquet")]
    argv += ["--aime_path", str(tmp_path / "aime-2024.parquet"), "--local_dir", str(out), "--dedup"]
    dapo.main([*argv, "--multiturn_w_tool"])
    rows = read_parquet(out / "train.parquet")
    assert [r["extra_info"]["index"] for r in rows] == ["a1", "b2"]  # one row per distinct prompt
    assert rows[0]["extra_info"] == {  # verl's dapo_multiturn_w_tool.py
        "index": "a1",
        "need_tools_kwargs": True,
        "tools_kwargs": {"code_interpreter": {"create_kwargs": {"ground_truth": "34"}}},
    }
    assert read_parquet(out / "test.parquet")[0]["reward_model"]["ground_truth"] == "204"
    result = default_compute_score(rows[0]["data_source"], "30 + 4 = 34.\nAnswer: 34", "34")
    assert result["score"] == 1.0 and result["acc"] is True
    assert default_compute_score(rows[0]["data_source"], "Answer: 35", "34")["score"] == -1.0


def test_dapo_rows_not_in_verls_layout_are_named(tmp_path):
    dapo = load("dapo_17k")
    write_parquet(tmp_path / "bad.parquet", [{"problem": "Find 1 + 1.", "answer": "2"}])
    with pytest.raises(ValueError, match="train row 0: 'prompt' must be a list"):
        dapo.convert(tmp_path / "bad.parquet", tmp_path / "out")
    no_source = {k: v for k, v in dapo_row("Find 1 + 1.", "2", "x").items() if k != "data_source"}
    write_parquet(tmp_path / "no_source.parquet", [no_source])
    written = dapo.convert(tmp_path / "no_source.parquet", tmp_path / "out")
    assert read_parquet(written["train"])[0]["data_source"] == "math_dapo"


# ----------------------------------------------------------------------------------------- geo3k

GEO3K_INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. "
    "The final answer MUST BE put in \\boxed{}."
)


def png(color: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (6, 4), color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_geometry3k_repository_with_images_becomes_verls_rows(tmp_path):
    geo3k = load("geo3k")
    source = tmp_path / "geometry3k"
    for split in ("train", "validation", "test"):  # hiyouga/geometry3k's columns: images, problem, answer
        write_parquet(
            source / "data" / f"{split}-00000-of-00001.parquet",
            [{"images": [{"bytes": png("red"), "path": None}], "problem": "<image>Find x.", "answer": "3"}],
        )
    out = tmp_path / "geo3k"
    geo3k.main(["--local_dataset_path", str(source), "--local_save_dir", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["test.parquet", "train.parquet"]
    row = read_parquet(out / "train.parquet")[0]
    assert row == {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": "<image>Find x. " + GEO3K_INSTRUCTION}],
        "images": [{"bytes": png("red"), "path": None}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "3"},
        "extra_info": {"split": "train", "index": 0, "answer": "3", "question": "<image>Find x."},
    }
    from hybridflow.utils.dataset.multimodal import load_image

    image, _ = load_image(row["images"][0], "geo3k row 0")  # what the RL dataset reads
    assert image.size == (6, 4) and image.getpixel((0, 0)) == (255, 0, 0)
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score(row["data_source"], "<think>x = 3</think> \\boxed{3}", truth) == 1.0
    assert default_compute_score(row["data_source"], "\\boxed{3}", truth) == pytest.approx(0.9)  # no format
