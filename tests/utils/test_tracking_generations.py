"""``Tracking.log_generations`` (verl's ValidationGenerationsLogger): (input, output, score) samples to
every backend that can show them."""

import json

import pytest

from hybridflow.utils.tracking import Tracking

SAMPLES = [("1+2=", "3", 1.0), ("4+5=", "8", 0.0)]


def test_jsonl_backend_appends_one_line_per_sample(tmp_path):
    with Tracking("proj", "exp", ["jsonl"], log_dir=str(tmp_path)) as tracker:
        tracker.log_generations(SAMPLES, step=3)
        tracker.log_generations(SAMPLES[:1], step=6)
    lines = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 3, "table": "val/generations", "input": "1+2=", "output": "3", "score": 1.0},
        {"step": 3, "table": "val/generations", "input": "4+5=", "output": "8", "score": 0.0},
        {"step": 6, "table": "val/generations", "input": "1+2=", "output": "3", "score": 1.0},
    ]
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # samples are not metrics


def test_console_backend_prints_each_sample(tmp_path, capsys):
    with Tracking("proj", "exp", "console", log_dir=str(tmp_path)) as tracker:
        tracker.log_generations(SAMPLES, step=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "val/generations step:2"
    assert out[1] == "  [1] score=1 input='1+2=' output='3'"
    assert out[2] == "  [2] score=0 input='4+5=' output='8'"


def test_tensorboard_backend_writes_a_text_panel(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    with Tracking("proj", "exp", ["tensorboard"], log_dir=str(tmp_path)) as tracker:
        tracker.log_generations(SAMPLES, step=4)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = [t for t in events.Tags()["tensors"] if t.startswith("val/generations")]
    (event,) = events.Tensors(text)
    body = event.tensor_proto.string_val[0].decode()
    assert event.step == 4 and "**Input:** 4+5=" in body and "**Output:** 3" in body


def test_wandb_table_gets_one_row_per_step_in_verls_columns(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")  # no service, no network: the table logic only
    with Tracking("proj", "exp", ["wandb"], log_dir=str(tmp_path)) as tracker:
        tracker.log_generations(SAMPLES, step=1)
        tracker.log_generations([("1+2=", "4", 0.0), ("4+5=", "9", 1.0)], step=2)
        table = tracker.backends["wandb"]._tables["val/generations"]
    assert table.columns == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert table.data == [[1, "1+2=", "3", 1.0, "4+5=", "8", 0.0], [2, "1+2=", "4", 0.0, "4+5=", "9", 1.0]]
