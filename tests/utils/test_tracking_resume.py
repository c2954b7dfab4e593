"""A resumed run's metrics.jsonl holds each step once: ``Tracking.rewind(step)`` drops what an interrupted
attempt logged after the checkpoint it resumes from (and a line cut short by a kill)."""

import json

from hybridflow.utils.tracking import Tracking


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_drops_the_steps_logged_after_the_checkpoint(tmp_path, capsys):
    first = Tracking("p", "e", ["jsonl"], log_dir=str(tmp_path))
    for step in (0, 1, 2, 3):
        first.log({"x": float(step)}, step=step)
    first.log_generations([("in", "out", 1.0)], step=3)
    first.finish()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "x": 4.')  # killed in the middle of a write

    resumed = Tracking("p", "e", ["jsonl"], log_dir=str(tmp_path))
    resumed.rewind(2)  # the checkpoint of step 2: steps 3 and 4 run again
    # steps 3 and 4 (cut short), and step 3's generation
    assert "dropped 3 records" in capsys.readouterr().out
    for step in (3, 4):
        resumed.log({"x": 10.0 + step}, step=step)
    resumed.finish()
    assert _steps(tmp_path / "metrics.jsonl") == [0, 1, 2, 3, 4]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[3])["x"] == 13.0
    assert (tmp_path / "val_generations.jsonl").read_text() == ""


def test_a_fresh_start_moves_the_previous_log_aside(tmp_path):
    old = Tracking("p", "e", ["jsonl"], log_dir=str(tmp_path))
    old.log({"x": 1.0}, step=1)
    old.finish()
    new = Tracking("p", "e", ["jsonl", "console"], log_dir=str(tmp_path))
    new.rewind(0)
    new.log({"x": 2.0}, step=1)
    new.finish()
    assert _steps(tmp_path / "metrics.jsonl") == [1]
    assert _steps(tmp_path / "metrics.jsonl.previous") == [1]


def test_rewind_keeps_a_log_without_later_steps_untouched(tmp_path):
    tracker = Tracking("p", "e", ["jsonl"], log_dir=str(tmp_path))
    tracker.log({"x": 1.0}, step=1)
    before = (tmp_path / "metrics.jsonl").stat().st_ino
    tracker.rewind(5)
    tracker.log({"x": 6.0}, step=6)
    tracker.finish()
    assert (tmp_path / "metrics.jsonl").stat().st_ino == before
    assert _steps(tmp_path / "metrics.jsonl") == [1, 6]
