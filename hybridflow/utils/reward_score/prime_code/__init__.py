"""PRIME's code scorer, verl's ``verl.utils.reward_score.prime_code``: the pass rate of a completion's
code on APPS-style test cases, run in the project's sandbox (:mod:`.utils`).

:func:`compute_score` ``(completion, test_cases, continuous=False) -> (score, metadata)``, as verl's:
the code is the text after the last ```` ```python ```` up to the next ```` ``` ```` (a completion that
is pure code is taken whole). All cases run first (5 s each); when all pass the score is ``True``.
Otherwise, with ``continuous``, the first 10 cases run one at a time (10 s each) and the score is the
fraction that passed, with per-case metadata (``test_case``: input, output, res); without it the
score is ``False``. ``test_cases`` is a dict or its JSON text (``inputs``, ``outputs``, optionally
``fn_name``). This is verl's fallback for ``codecontests``/``apps``/``codeforces``/``taco`` rows when no
``sandbox_fusion_url`` is set (:mod:`hybridflow.utils.reward_score.sandbox_fusion`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from hybridflow.utils.reward_score.prime_code.utils import SandboxUnavailable, check_correctness

logger = logging.getLogger(__name__)

FULL_RUN_TIMEOUT_S = 5
CASE_TIMEOUT_S = 10
CONTINUOUS_CASES = 10  # do not test every case of problems with enormous test sets


def extract_code(completion: str) -> str:
    """The text after the last ```` ```python ```` (up to the next fence), or the whole completion."""
    return completion.split("```python")[-1].split("```")[0]


def _single_case(solution: str, test_cases: dict, index: int) -> tuple[list, dict]:
    case = {"inputs": [test_cases["inputs"][index]], "outputs": [test_cases["outputs"][index]]}
    if test_cases.get("fn_name") is not None:
        case["fn_name"] = test_cases["fn_name"]
    results, metadata = check_correctness(
        in_outs=case, generation=solution, timeout=CASE_TIMEOUT_S, debug=False
    )
    info = dict(metadata[0]) if metadata else {}  # metadata can be empty (a global timeout)
    info["test_case"] = {
        "input": str(case["inputs"][0]),
        "output": str(case["outputs"][0]),
        "res": str(results),
    }
    return results, info


def compute_score(completion: str, test_cases: Any, continuous: bool = False) -> tuple[float | bool, Any]:
    """``(score, metadata)`` for ``completion`` on ``test_cases`` (module docstring)."""
    solution = extract_code(completion)
    try:
        if not isinstance(test_cases, dict):
            test_cases = json.loads(test_cases)
        results, metadata = check_correctness(
            in_outs=test_cases, generation=solution, timeout=FULL_RUN_TIMEOUT_S, debug=False
        )
        if results and all(r is True for r in results):
            return True, metadata[0] if metadata else {}
        if not continuous:
            return False, metadata
        passed, tried, infos = 0, 0, []
        for index in range(min(len(test_cases["inputs"]), CONTINUOUS_CASES)):
            case_results, info = _single_case(solution, test_cases, index)
            passed += sum(r is True for r in case_results)
            tried += len(case_results)
            infos.append(info)
        return passed / max(tried, 1), infos
    except SandboxUnavailable:
        raise  # the machine's problem, not the sample's
    except Exception:  # a malformed test case: the sample fails, as in verl
        logger.exception("prime_code: scoring failed")
        return False, None
