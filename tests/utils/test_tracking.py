import json

import numpy as np
import pytest
import torch

from hybridflow.utils.timer import Timer, marked_timer
from hybridflow.utils.tracking import Tracking, register_tracker, registered_trackers


def test_console_line_sorted_and_compact(capsys, tmp_path):
    tracker = Tracking("proj", "exp", "console", log_dir=str(tmp_path))
    tracker.log({"critic/score/mean": 0.5, "actor/pg_loss": 0.0123456, "perf/total_num_tokens": 12}, step=3)
    tracker.finish()
    line = capsys.readouterr().out.strip()
    assert line == "step:3 - actor/pg_loss:0.01235 - critic/score/mean:0.5 - perf/total_num_tokens:12"


def test_jsonl_lines_parse_and_match(tmp_path):
    tracker = Tracking("proj", "exp", ["jsonl"], log_dir=str(tmp_path))
    tracker.log({"a": 1, "b": np.float32(0.25), "c": torch.tensor(2.5)}, step=1)
    with pytest.warns(UserWarning, match="non-numeric metric 'note'"):
        tracker.log({"a": 2.0, "note": "text"}, step=2)
    # Flushed per line: readable before finish().
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    tracker.finish()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "a": 1.0, "b": 0.25, "c": 2.5},
        {"step": 2, "a": 2.0},
    ]


def test_file_alias_and_default_log_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Tracking("proj", "exp", ["file", "jsonl"]) as tracker:
        tracker.log({"x": 1.0}, step=0)
    assert len(tracker.backends) == 1  # the alias opens one writer, not two
    assert (tmp_path / "outputs/proj/exp/metrics.jsonl").read_text().strip() == '{"step": 0, "x": 1.0}'


def test_unknown_backend_lists_registered():
    with pytest.raises(ValueError, match="registered: .*console.*jsonl"):
        Tracking("proj", "exp", ["console", "nosuch"])


def test_register_conflict_raises():
    assert "wandb" in registered_trackers()
    with pytest.raises(ValueError, match="already registered"):
        register_tracker("console")(type("Other", (), {}))


def test_tensorboard_writes_events(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    tracker = Tracking("proj", "exp", "tensorboard", config={"lr": 1e-6}, log_dir=str(tmp_path))
    tracker.log({"actor/pg_loss": 0.1}, step=1)
    tracker.finish()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    tracker = Tracking("proj", "exp", "wandb", config={"lr": 1e-6}, log_dir=str(tmp_path))
    tracker.log({"actor/pg_loss": 0.1}, step=1)
    tracker.finish()
    assert (tmp_path / "wandb").exists()


def test_marked_timer_accumulates():
    timing: dict[str, float] = {}
    with marked_timer("gen", timing) as timer:
        pass
    first = timing["gen"]
    assert first == timer.last >= 0
    with pytest.raises(RuntimeError):
        with marked_timer("gen", timing):
            raise RuntimeError("boom")
    assert timing["gen"] >= first  # recorded despite the exception
    with Timer() as t:
        pass
    assert t.total == t.last and not t.running
