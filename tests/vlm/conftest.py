"""Fixtures of the vision-language tests: a tiny Qwen2.5-VL directory and geo3k-layout parquet files of
the synthetic visual task (hybridflow/tasks/visual.py)."""

import pytest


@pytest.fixture(scope="session")
def vlm_model_dir(tmp_path_factory):
    from hybridflow.models.tiny_vlm import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / "model"))


@pytest.fixture(scope="session")
def visual_data(tmp_path_factory):
    """``(train, test)`` parquet paths: 1 row per answer per question type (9 rows each)."""
    from hybridflow.tasks.visual import make_rows, write_parquet

    root = tmp_path_factory.mktemp("visual_data")
    return (
        write_parquet(make_rows(1, seed=0, split="train"), root / "train.parquet"),
        write_parquet(make_rows(1, seed=0, split="test"), root / "test.parquet"),
    )
