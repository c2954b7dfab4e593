"""verl's ``verl.utils.reward_score.sandbox_fusion``: code rewards from test cases run on SandboxFusion.

Any server that speaks SandboxFusion's ``POST /run_code`` works: ByteDance's SandboxFusion, a hosted
FaaS, or this project's ``python -m hybridflow.sandbox serve`` (docs/sandbox_fusion.md).

:func:`compute_score` has verl's signature and result: the code is the last ```` ```python ```` block of
the completion (or the first ```` ``` ```` block, without its language line); a completion without a
code block scores 0.0. The score is the fraction of test cases passed (``continuous=True``: of the
first 10), with the per-case metadata of :func:`.utils.check_correctness`.

The data sources verl scores this way — ``codecontests``, ``apps``, ``codeforces``, ``taco`` — are
registered with ``default_compute_score`` (:func:`code_contests_score`). With the server's URL
(``reward_model.sandbox_fusion.url`` in the trainer config, or ``sandbox_fusion_url=`` when calling
``default_compute_score``) they run there; without one they fall back, as in verl, to
:mod:`hybridflow.utils.reward_score.prime_code`, which runs them in this machine's sandbox. A server
that is down or answers junk is never silent: such a row scores its passed cases and returns a dict with
``sandbox_error`` (:func:`code_contests_score`).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from hybridflow.utils.reward_score.registry import register_scorer
from hybridflow.utils.reward_score.sandbox_fusion.utils import check_correctness, is_sandbox_fault

logger = logging.getLogger(__name__)
_WARNED_URLS: set[str] = set()  # servers whose faults were logged (once per URL and process)
_WARNED_LOCK = threading.Lock()

CONTINUOUS_CASES = 10  # continuous=True scores the first this many cases
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
DEFAULT_MEMORY_LIMIT_MB = 1024  # verl's reward_model.sandbox_fusion.memory_limit_mb default


def extract_code(completion: str) -> str | None:
    """The code of ``completion``: its last ```` ```python ```` block, else its first ```` ``` ```` block
    (a first line that is one word of letters, a language name, is dropped); None without a block."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" not in completion:
        return None
    block = completion.split("```")[1]
    first_line, newline, rest = block.partition("\n")
    return rest if newline and first_line.strip().isalpha() else block


def compute_score(
    sandbox_fusion_url,
    concurrent_semaphore,
    memory_limit_mb,
    completion,
    test_cases,
    continuous=False,
    timeout=10,
) -> tuple[float, list[dict[str, Any]]]:
    """``(score in [0, 1], per-case metadata)`` for ``completion`` against ``test_cases`` (a dict or its
    JSON text with ``inputs``/``outputs``, or ``assert_case`` snippets, and optionally ``fn_name``)."""
    solution = extract_code(completion)
    if solution is None:
        return 0.0, [{"error": "Invalid completion (missing code block)"}]
    if not isinstance(test_cases, dict):
        try:
            test_cases = json.loads(test_cases)
        except (TypeError, ValueError) as error:
            logger.error("sandbox_fusion: test_cases is not JSON: %s", error)
            return 0.0, [{"error": "Invalid test_cases JSON format"}]
    if not isinstance(test_cases, dict):
        return 0.0, [{"error": "Invalid test_cases structure (missing inputs/outputs)"}]
    if isinstance(test_cases.get("assert_case"), list):
        test_cases = dict(test_cases)
        test_cases.setdefault("inputs", [""] * len(test_cases["assert_case"]))
        test_cases.setdefault("outputs", [None] * len(test_cases["assert_case"]))
    elif "inputs" not in test_cases or "outputs" not in test_cases:
        return 0.0, [{"error": "Invalid test_cases structure (missing inputs/outputs)"}]
    try:
        results, metadata = check_correctness(
            sandbox_fusion_url=sandbox_fusion_url,
            in_outs=test_cases,
            generation=solution,
            timeout=timeout,
            memory_limit_mb=memory_limit_mb,
            concurrent_semaphore=concurrent_semaphore,
        )
    except Exception as error:  # scoring never raises for a bad sample
        logger.exception("sandbox_fusion: compute_score failed")
        return 0.0, [{"error": f"Unhandled exception: {error}"}]
    if not results:
        return 0.0, metadata
    considered = results[:CONTINUOUS_CASES] if continuous else results
    return sum(1 for result in considered if result is True) / len(considered), metadata


@register_scorer(*CODE_DATA_SOURCES)
def code_contests_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    sandbox_fusion_url: str | None = None,
    concurrent_semaphore: Any = None,
    memory_limit_mb: int | None = None,
) -> float | dict[str, float]:
    """verl's ``default_compute_score`` branch for code data sources: the pass rate of the first 10 test
    cases in ``ground_truth``, on the SandboxFusion server at ``sandbox_fusion_url``, else in the local
    sandbox by :mod:`~hybridflow.utils.reward_score.prime_code`.

    The pass rate is a float, as verl's. When the server gave no verdict on some cases (down, slow,
    answering junk or its own ``SandboxError``: :func:`.utils.is_sandbox_fault`), those cases count as
    failed and the result is ``{"score": pass rate, "sandbox_error": number of such cases}``, so that the
    reward manager carries ``sandbox_error`` in its extra info (a per-sample column; the reward loop's
    ``reward/failures/sandbox_error`` metric), and a warning names the URL (once per URL and process)."""
    if not sandbox_fusion_url:
        from hybridflow.utils.reward_score import prime_code

        return float(prime_code.compute_score(solution_str, ground_truth, continuous=True)[0])
    memory = DEFAULT_MEMORY_LIMIT_MB if memory_limit_mb is None else memory_limit_mb
    score, metadata = compute_score(
        sandbox_fusion_url, concurrent_semaphore, memory, solution_str, ground_truth, continuous=True
    )
    faults = [case for case in metadata if is_sandbox_fault(case)]
    if not faults:
        return float(score)
    _warn_once(str(sandbox_fusion_url), len(faults), len(metadata), faults[0])
    return {"score": float(score), "sandbox_error": float(len(faults))}


def _warn_once(url: str, faults: int, cases: int, first: dict) -> None:
    with _WARNED_LOCK:
        if url in _WARNED_URLS:
            return
        _WARNED_URLS.add(url)
    reason = first.get("api_request_error") or first.get("status")
    logger.warning(
        "sandbox_fusion: the SandboxFusion server at %s gave no verdict on %d of %d test cases (%s); "
        "they count as failed, and the reward's extra info counts them in 'sandbox_error' "
        "(warned once per URL)",
        url,
        faults,
        cases,
        reason,
    )


__all__ = ["CODE_DATA_SOURCES", "check_correctness", "code_contests_score", "compute_score", "extract_code"]
