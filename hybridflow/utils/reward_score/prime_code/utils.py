"""verl's ``verl.utils.reward_score.prime_code.utils`` (and its ``testing_util``): a generation checked
against APPS-style test cases, the code run in the project's sandbox, never in this process.

:func:`check_correctness` ``(in_outs, generation, timeout=10, debug=True) -> (results, metadata)``
runs all of ``in_outs["inputs"]`` in one fresh sandbox (:mod:`hybridflow.utils.sandbox`: its own
filesystem, no network, no privileges, memory and process limits) through :mod:`._harness`, each case
with ``timeout`` seconds, and compares the outputs here, as verl's ``run_test`` does:

* ``fn_name`` given (call-based): the return value (sent back as JSON) equals the JSON-decoded expected
  output, or its first element; dicts with integer keys are compared as such;
* otherwise (standard input): stdout equals the expected text after stripping (line by line too),
  or as lines with blank lines dropped, or as numbers within ``numpy.allclose``'s tolerance when not
  all tokens are integers.

``results`` is verl's list, cut after the first failure: ``True``, ``False`` (wrong answer), ``-1``
(runtime error or the case's timeout), ``-2`` (the code does not compile or load, or ``fn_name`` is
missing). When the whole run outlives ``timeout + 1`` seconds (plus the sandbox's start) or the
process dies, every case is ``-1`` and the metadata empty, as verl's global timeout does. ``metadata``
holds one dict: ``{}`` when all passed, else verl's ``output``/``expected``/``inputs``/``error_message``
or ``error``/``traceback``. A sandbox that cannot start on this machine raises :class:`SandboxUnavailable`.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from pathlib import Path
from typing import Any

from hybridflow.utils.sandbox import SandboxLimits, SandboxResult, run_python

HARNESS_SOURCE = (Path(__file__).parent / "_harness.py").read_text(encoding="utf-8")
MARK = "@@hybridflow-prime-code@@ "
SANDBOX_START_S = 2.0  # the sandbox's own start, on top of verl's timeout + 1
MEMORY_MB = 1024
MIB = 1 << 20
RUNTIME_ERROR, COMPILE_ERROR = -1, -2


class SandboxUnavailable(RuntimeError):
    """The sandbox could not start here: an infrastructure problem, never a sample's score."""


def truncatefn(s: str, length: int = 300) -> str:
    """``s`` cut to ``length`` characters around a ``...(truncated) ...`` marker."""
    return s if len(s) <= length else s[: length // 2] + "...(truncated) ..." + s[-length // 2 :]


def _limits(source: str, timeout: float, cases: int) -> SandboxLimits:
    return SandboxLimits(
        wall_timeout_s=timeout + 1 + SANDBOX_START_S,
        cpu_time_s=math.ceil(timeout + 1 + SANDBOX_START_S),
        memory_mb=MEMORY_MB,
        max_output_bytes=(cases + 1) * (MIB + 4096),
        max_file_bytes=len(source.encode("utf-8")) + 64 * MIB,
        max_disk_mb=256,
    )


def _run_blocking(coro_fn):
    """Run ``coro_fn()`` to completion from synchronous code, inside a running event loop too."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_fn())
    box: list = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(coro_fn())), daemon=True)
    thread.start()
    thread.join()
    if not box:
        raise SandboxUnavailable("prime_code: the sandbox run failed in its helper thread")
    return box[0]


def run_cases(generation: str, inputs: list[str], fn_name: str | None, timeout: float) -> SandboxResult:
    """One sandbox run of the harness over ``inputs``."""
    config = {"code": generation, "inputs": inputs, "fn_name": fn_name, "timeout": timeout}
    source = f"{HARNESS_SOURCE}\n\nrun(json.loads({json.dumps(json.dumps(config))}))\n"
    result = _run_blocking(lambda: run_python(source, _limits(source, timeout, len(inputs))))
    if result.killed_reason in ("sandbox setup failed", "sandbox error"):
        reason = result.stderr.strip()[:300]
        raise SandboxUnavailable(f"prime_code: the sandbox cannot run code here: {reason}")
    return result


def _reports(stdout: str) -> list[dict[str, Any]]:
    reports = []
    for line in stdout.splitlines():
        if line.startswith(MARK):
            try:
                reports.append(json.loads(line[len(MARK) :]))
            except ValueError:
                continue  # a line cut by the output limit
    return reports


def _all_close(output: list[str], expected: list[str]) -> bool:
    """verl's float comparison: not all integer tokens, same length, ``numpy.allclose``'s tolerance."""
    if len(output) != len(expected) or all(e1.isdigit() and e2.isdigit() for e1, e2 in zip(output, expected)):
        return False
    try:
        pairs = [(float(a), float(b)) for a, b in zip(output, expected)]
    except ValueError:
        return False
    return all(abs(a - b) <= 1e-8 + 1e-5 * abs(b) for a, b in pairs)


def stdout_matches(stdout: str, expected: Any) -> bool:
    """verl's standard-input comparison of a program's ``stdout`` with the expected output."""
    if isinstance(expected, list):
        expected = "\n".join(expected)
    expected = str(expected)
    lines = stdout.splitlines()
    if "\n".join(lines).strip() == expected.strip():
        return True
    if "\n".join(line.strip() for line in lines).strip() == expected.strip():
        return True
    if lines == [expected]:
        return True
    expected_lines = [line.strip() for line in expected.split("\n") if line]
    if lines == expected_lines:
        return True
    lines = [line for line in lines if line]
    return lines == expected_lines or _all_close(lines, expected_lines)


def _dict_int_keys(value: Any) -> Any:
    if isinstance(value, dict):
        try:
            return {int(k): v for k, v in value.items()}
        except (ValueError, TypeError):
            return value
    return value


def value_matches(value_json: str, expected_json: Any) -> bool:
    """verl's call-based comparison of a return value with the expected output (both JSON)."""
    output = _dict_int_keys(json.loads(value_json))
    expected = json.loads(expected_json) if isinstance(expected_json, str) else expected_json
    if isinstance(expected, dict):
        expected = [_dict_int_keys(expected)]
    elif isinstance(expected, list) and expected and isinstance(expected[0], dict):
        expected = [_dict_int_keys(expected[0])]
    if output == expected:
        return True
    return isinstance(expected, list) and bool(expected) and output == expected[0]


def _case_result(report: dict[str, Any], raw_input: str, expected: Any, fn_name: str | None):
    """``(result, metadata or None)`` for one case's report."""
    status = report.get("status")
    if status == "compile_error":
        return COMPILE_ERROR, {"error": report.get("error"), "traceback": report.get("traceback")}
    if status != "ok":
        return RUNTIME_ERROR, {"error": report.get("error"), "traceback": report.get("traceback")}
    if fn_name is None:
        passed, shown = stdout_matches(report.get("stdout", ""), expected), report.get("stdout", "")
    else:
        shown = report.get("value", "null")
        passed = "value" in report and value_matches(report["value"], expected)
    if passed:
        return True, None
    wrong = {"output": truncatefn(str(shown), 200), "expected": truncatefn(str(expected), 200)}
    return False, {**wrong, "inputs": truncatefn(str(raw_input)), "error_message": "Wrong Answer"}


def check_correctness(in_outs: dict | None, generation: str, timeout=10, debug=True) -> tuple[list, list]:
    """``(results, [metadata])`` for ``generation`` on ``in_outs`` (module docstring); ``debug`` is
    accepted for verl's signature."""
    if not in_outs or "inputs" not in in_outs or "outputs" not in in_outs:
        raise ValueError("prime_code check_correctness: in_outs needs 'inputs' and 'outputs'")
    inputs = ["\n".join(i) if isinstance(i, list) else str(i) for i in in_outs["inputs"]]
    outputs, fn_name = in_outs["outputs"], in_outs.get("fn_name")
    run = run_cases(generation, inputs, fn_name, timeout)
    reports = _reports(run.stdout)
    if run.timed_out or run.exit_code != 0:
        return [RUNTIME_ERROR] * len(inputs), []  # verl's global timeout (or a crash): every case fails
    results: list = []
    for index, report in enumerate(reports[: len(inputs)]):
        if report.get("status") == "compile_error":
            return [COMPILE_ERROR], [_case_result(report, "", None, fn_name)[1]]
        result, metadata = _case_result(report, inputs[index], outputs[index], fn_name)
        results.append(result)
        if metadata is not None:
            return results, [metadata]
    if len(results) < len(inputs):  # the harness stopped without saying why
        return [RUNTIME_ERROR] * len(inputs), []
    return results, [{}]
