"""verl's ``verl.utils.reward_score.sandbox_fusion.utils``: test cases run on a SandboxFusion server.

:func:`check_correctness` runs ``generation`` once per test case (``in_outs["inputs"][i]`` as stdin,
``in_outs["outputs"][i]`` the expected stdout, compared after stripping trailing newlines), the cases
concurrently (at most ``concurrent_semaphore``'s count at once, when given), and returns
``(results, metadata)`` in input order. Each result is verl's code:

* ``True`` / ``False``: it ran and printed the expected output / something else;
* ``-1``: the API call failed (server down, slow, HTTP error, not JSON) or the sandbox reported a
  ``SandboxError`` (e.g. a language it does not run);
* ``-2``: a runtime error (non-zero return code); ``-3``: the run timed out;
* ``-4``: compiling failed or timed out; once a case gets -4, every later case is marked -4 too
  (``status: "compile_error_skipped"``).

Each metadata dict has verl's keys: ``case_index, input, expected_output, api_request_error,
api_response, status, stdout, stderr, exit_code, duration, compile_duration, compile_stderr,
api_status, compile_status, run_status``. ``in_outs["fn_name"]`` (Python) calls that function with each
input's lines as JSON arguments (:mod:`.harness`); ``in_outs["assert_case"]`` appends one snippet per
case to the code (an expected output of ``None`` then only needs a clean run).

:func:`call_sandbox_api` is one ``POST`` to the URL (the full ``.../run_code`` address) with
verl's payload, retried on HTTP 504 only (``MAX_RETRIES`` tries, 1 s, 2 s ... apart); its timeout is
``compile_timeout + run_timeout + API_TIMEOUT``. It never raises: ``(response_json, None)`` or
``(None, "API Call Failed: ...")``. httpx is the client (imported at the first call).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

from hybridflow.utils.reward_score.sandbox_fusion.harness import wrap_function_call

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10  # seconds, for compiling and for running each case
MAX_RETRIES = 3
INITIAL_RETRY_DELAY = 1
API_TIMEOUT = 10  # seconds on top of the code's own timeouts before the HTTP call gives up
MAX_WORKERS = 32  # threads per check_correctness call (the semaphore bounds the calls in flight)

# SandboxFusion's language names; a name outside the list is refused before any call, as in verl
SUPPORTED_LANGUAGES = [
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
    "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
    "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket",
]  # fmt: skip

RESULT_SANDBOX_ERROR, RESULT_RUNTIME_ERROR, RESULT_TIMEOUT, RESULT_COMPILE_ERROR = -1, -2, -3, -4
# a case's metadata status when the server gave no verdict on the code (down, junk, its own error)
SANDBOX_FAULT_STATUSES = frozenset(
    {
        "api_error", "sandbox_error", "malformed_response", "unexpected_success_state",
        "unknown_failure_state", "unknown_failure", "internal_error",
    }
)  # fmt: skip


def call_sandbox_api(
    sandbox_fusion_url: str,
    code: str,
    stdin: str | None,
    compile_timeout: int,
    run_timeout: int,
    memory_limit_mb: int,
    language: str = "python",
) -> tuple[dict[str, Any] | None, str | None]:
    """POST one run to ``sandbox_fusion_url``; ``(response_json, None)`` or ``(None, error message)``."""
    if language not in SUPPORTED_LANGUAGES:
        return None, f"API Call Failed: Unsupported language: {language}"
    import httpx

    payload = {
        "compile_timeout": compile_timeout,
        "run_timeout": run_timeout,
        "code": code,
        "stdin": stdin,
        "memory_limit_MB": memory_limit_mb,
        "language": language,
        "files": {},
        "fetch_files": [],
    }
    request_timeout = compile_timeout + run_timeout + API_TIMEOUT
    error = "no attempt made"
    for attempt in range(1, MAX_RETRIES + 1):
        try:
            response = httpx.post(
                sandbox_fusion_url,
                json=payload,
                headers={"Accept": "application/json"},
                timeout=request_timeout,
            )
        except httpx.HTTPError as exc:  # refused, reset, timed out, a bad URL...
            return None, f"API Call Failed: API Request Error: {type(exc).__name__}: {exc}"
        except Exception as exc:  # e.g. a URL httpx cannot parse
            return None, f"API Call Failed: Unexpected Error: {type(exc).__name__}: {exc}"
        if response.status_code == 504:
            error = f"API Request Error: Gateway Timeout (504) on attempt {attempt}/{MAX_RETRIES}"
            logger.warning("sandbox fusion: %s", error)
            if attempt < MAX_RETRIES:
                time.sleep(INITIAL_RETRY_DELAY * attempt)
            continue
        if response.status_code >= 400:
            reason = f"HTTP {response.status_code}: {response.text[:300]}"
            return None, f"API Call Failed: API Request Error: {reason}"
        try:
            data = response.json()
        except ValueError as exc:
            return None, f"API Call Failed: API Response JSON Decode Error: {exc}"
        if not isinstance(data, dict):
            return None, f"API Call Failed: API Response is not a JSON object: {response.text[:300]}"
        return data, None
    return None, f"API Call Failed: {error}"


def is_sandbox_fault(metadata: Any) -> bool:
    """Whether a case's metadata says the server, not the code, failed: the call failed (down, slow,
    not JSON), or the server answered a ``SandboxError`` or something that is not a SandboxFusion
    answer (result ``-1``)."""
    status = metadata.get("status") if isinstance(metadata, dict) else None
    return isinstance(status, str) and (
        status in SANDBOX_FAULT_STATUSES or status.startswith("unknown_api_status_")
    )


def empty_metadata(case_index: int, stdin: str | None, expected_output: Any) -> dict[str, Any]:
    """A case's metadata before the call, every one of verl's keys present."""
    return {
        "case_index": case_index,
        "input": stdin,
        "expected_output": str(expected_output) if expected_output else None,
        "api_request_error": None,
        "api_response": None,
        "status": "unknown",
        "stdout": None,
        "stderr": None,
        "exit_code": None,
        "duration": None,
        "compile_duration": None,
        "compile_stderr": None,
        "api_status": None,
        "compile_status": None,
        "run_status": None,
    }


def classify_response(
    api_response: dict[str, Any], expected_output: Any, metadata: dict[str, Any]
) -> bool | int:
    """Fill ``metadata`` from a SandboxFusion response and return verl's result code for the case."""
    metadata["api_response"] = api_response
    metadata["api_status"] = api_status = api_response.get("status")
    compile_result = api_response.get("compile_result") or {}
    run_result = api_response.get("run_result") or {}
    if not isinstance(compile_result, dict) or not isinstance(run_result, dict):
        metadata["status"] = "malformed_response"
        return RESULT_SANDBOX_ERROR
    if compile_result:
        metadata["compile_status"] = compile_result.get("status")
        metadata["compile_duration"] = compile_result.get("execution_time")
        metadata["compile_stderr"] = compile_result.get("stderr")
    if run_result:
        metadata["run_status"] = run_result.get("status")
        metadata["stdout"] = run_result.get("stdout")
        metadata["stderr"] = run_result.get("stderr")
        metadata["exit_code"] = run_result.get("return_code")
        metadata["duration"] = run_result.get("execution_time")
    if api_status == "SandboxError":
        metadata["status"] = "sandbox_error"
        return RESULT_SANDBOX_ERROR
    if api_status == "Success":
        if not run_result or metadata["run_status"] != "Finished":
            metadata["status"] = "unexpected_success_state"
            return RESULT_SANDBOX_ERROR
        actual = str(metadata["stdout"] if metadata["stdout"] is not None else "")
        passed = expected_output is None or actual.rstrip("\n") == str(expected_output).rstrip("\n")
        metadata["status"] = "success" if passed else "wrong_answer"
        return passed
    if api_status != "Failed":
        metadata["status"] = f"unknown_api_status_{api_status}"
        return RESULT_SANDBOX_ERROR
    compile_status = metadata["compile_status"]
    if compile_result and (
        compile_status in ("Error", "TimeLimitExceeded")
        or (compile_status == "Finished" and compile_result.get("return_code") != 0)
    ):
        metadata["status"] = "compile_timeout" if compile_status == "TimeLimitExceeded" else "compile_error"
        return RESULT_COMPILE_ERROR
    if not run_result:
        metadata["status"] = "unknown_failure_state"
        return RESULT_SANDBOX_ERROR
    run_status = metadata["run_status"]
    if run_status == "TimeLimitExceeded":
        metadata["status"] = "timeout"
        return RESULT_TIMEOUT
    if run_status == "Error" or (run_status == "Finished" and run_result.get("return_code") != 0):
        metadata["status"] = "runtime_error"
        return RESULT_RUNTIME_ERROR
    metadata["status"] = "unknown_failure"
    return RESULT_SANDBOX_ERROR


def _process_single_case(
    case_index: int,
    stdin_data: Any,
    expected_output: Any,
    sandbox_fusion_url: str,
    generation: str,
    timeout: int,
    memory_limit_mb: int,
    language: str,
    concurrent_semaphore: Any = None,
    fn_name: str | None = None,
) -> tuple[bool | int, dict[str, Any]]:
    """Run one case (verl's helper, also what verl's SandboxFusionTool calls); never raises."""
    code = wrap_function_call(generation, fn_name) if fn_name and language == "python" else generation
    stdin = None if stdin_data is None else str(stdin_data)
    metadata = empty_metadata(case_index, stdin, expected_output)
    request = {  # by keyword, as verl calls it (tests that mock call_sandbox_api read these names)
        "sandbox_fusion_url": sandbox_fusion_url,
        "code": code,
        "stdin": stdin,
        "compile_timeout": timeout,
        "run_timeout": timeout,
        "memory_limit_mb": memory_limit_mb,
        "language": language,
    }
    try:
        if concurrent_semaphore is not None:
            with concurrent_semaphore:
                response, error = call_sandbox_api(**request)
        else:
            response, error = call_sandbox_api(**request)
    except Exception as exc:  # e.g. a broken semaphore proxy
        response, error = None, f"API Request Exception for case {case_index + 1}: {exc}"
    if error is not None or response is None:
        metadata["api_request_error"] = error or "no response"
        metadata["status"] = "api_error"
        logger.error("sandbox fusion case %d: %s", case_index, metadata["api_request_error"])
        return RESULT_SANDBOX_ERROR, metadata
    return classify_response(response, expected_output, metadata), metadata


def check_correctness(
    sandbox_fusion_url: str,
    in_outs: dict | None,
    generation: str,
    timeout: int = DEFAULT_TIMEOUT,
    memory_limit_mb: int = 1024,
    language: str = "python",
    concurrent_semaphore: threading.Semaphore | None = None,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Run ``generation`` on every test case of ``in_outs``; ``(results, metadata)`` (module docstring)."""
    if not in_outs or "inputs" not in in_outs or "outputs" not in in_outs:
        return [RESULT_SANDBOX_ERROR], [{"error": "Invalid input/output data"}]
    inputs, outputs = in_outs["inputs"], in_outs["outputs"]
    count = len(inputs)
    if count == 0:
        return [], []
    assert_cases = in_outs.get("assert_case", [""] * count)
    if len(outputs) != count or len(assert_cases) != count:
        mismatch = [{"error": "Input/output count mismatch", "case_index": i} for i in range(count)]
        return [RESULT_SANDBOX_ERROR] * count, mismatch
    fn_name = in_outs.get("fn_name")
    results: list[Any] = [None] * count
    metadata: list[dict[str, Any]] = [{}] * count
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(count, MAX_WORKERS)) as pool:
        futures = {
            pool.submit(
                _process_single_case,
                i,
                inputs[i],
                outputs[i],
                sandbox_fusion_url,
                generation + "\n\n" + assert_cases[i] if assert_cases[i] else generation,
                timeout,
                memory_limit_mb,
                language,
                concurrent_semaphore,
                fn_name,
            ): i
            for i in range(count)
        }
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            try:
                results[i], metadata[i] = future.result()
            except Exception as exc:  # a bug above: this case only
                results[i] = RESULT_SANDBOX_ERROR
                metadata[i] = {
                    "case_index": i,
                    "input": str(inputs[i]),
                    "expected_output": str(outputs[i]) if outputs[i] else None,
                    "api_request_error": f"Internal execution error: {exc}",
                    "status": "internal_error",
                }
    first_compile_error = next((i for i, r in enumerate(results) if r == RESULT_COMPILE_ERROR), None)
    if first_compile_error is not None:
        for i in range(first_compile_error + 1, count):
            if results[i] != RESULT_COMPILE_ERROR:
                results[i] = RESULT_COMPILE_ERROR
                metadata[i]["status"] = "compile_error_skipped"
    return results, metadata
