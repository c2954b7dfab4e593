import json

import pytest

from hybridflow.utils.plot_metrics import main, plot_metrics, smooth

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def metrics_file(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as f:
        for step in range(1, 21):
            record = {"step": step, "critic/score/mean": step / 20, "actor/pg_loss": 1 / step, "other": 1.0}
            if step % 5 == 0:  # validation every 5 steps
                record["val-core/gsm8k/reward/mean@1"] = step / 25
            f.write(json.dumps(record) + "\n")
    return path


def test_default_keys_png(metrics_file, tmp_path):
    out = plot_metrics(metrics_file, tmp_path / "curves.png")
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000


def test_explicit_keys_and_cli(metrics_file, tmp_path, capsys):
    main([str(metrics_file), "--out", str(tmp_path / "c.png"), "--keys", "other", "val-core/*"])
    assert (tmp_path / "c.png").read_bytes().startswith(PNG_SIGNATURE)
    with pytest.raises(ValueError, match="not in the file"):
        plot_metrics(metrics_file, tmp_path / "d.png", keys=["missing/key"])


def test_smooth_is_bias_corrected():
    assert smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
