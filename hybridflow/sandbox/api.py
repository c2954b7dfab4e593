"""The request and response shapes of SandboxFusion's ``POST /run_code``, as its clients send and read them.

Request (JSON)::

    {"code": "...", "language": "python", "stdin": "1 2\\n",
     "compile_timeout": 10, "run_timeout": 10, "memory_limit_MB": 1024,
     "files": {"data/in.txt": "<base64>"}, "fetch_files": ["out.txt"]}

Response::

    {"status": "Success" | "Failed" | "SandboxError", "message": "",
     "compile_result": null | {...}, "run_result": null | {...},
     "executor_pod_name": null, "files": {"out.txt": "<base64>"}}

where each ``*_result`` is ``{"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time":
seconds, "return_code": int | null, "stdout": str, "stderr": str}``. ``compile_result`` is null for
interpreted languages and ``run_result`` is null when the compile step failed. The top-level status
follows SandboxFusion: ``SandboxError`` when a step could not be run at all (``Error``) or the request
could not be served (``message`` says why), ``Failed`` when a step timed out or exited non-zero,
``Success`` otherwise. A ``TimeLimitExceeded`` step has no return code. ``language`` is any string
here (SandboxFusion validates it against its list): a language this server does not run is a
``SandboxError`` naming it, not a validation error.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field

from hybridflow.utils.reward_score.sandbox_fusion.utils import SUPPORTED_LANGUAGES

# SandboxFusion's language names (its ``Language`` literal, the list verl's client checks against); the
# ones this server runs are in hybridflow.sandbox.languages
SANDBOX_FUSION_LANGUAGES = tuple(SUPPORTED_LANGUAGES)


class RunStatus(StrEnum):
    """The whole request's outcome."""

    SUCCESS = "Success"  # every step finished with return code 0
    FAILED = "Failed"  # a step timed out or returned non-zero
    SANDBOX_ERROR = "SandboxError"  # the sandbox could not run a step, or could not serve the request


class CommandRunStatus(StrEnum):
    """One step's (compile or run) outcome."""

    FINISHED = "Finished"  # it ended on its own (any return code, also a signal: negative)
    TIME_LIMIT_EXCEEDED = "TimeLimitExceeded"  # killed at its timeout (or its CPU-time limit)
    ERROR = "Error"  # it could not be started


class RunCodeRequest(BaseModel):
    """``POST /run_code``'s body; unknown fields are ignored, as SandboxFusion does."""

    code: str = Field(..., description="the source code to run")
    language: str = Field(..., description="a SandboxFusion language name, e.g. python, cpp, bash")
    stdin: str | None = Field(None, description="text passed to the program's standard input")
    compile_timeout: float = Field(10, description="seconds the compile step may take (compiled languages)")
    run_timeout: float = Field(10, description="seconds the run step may take")
    memory_limit_MB: int = Field(-1, description="address-space limit of each step; <= 0: the server's cap")
    files: dict[str, str | None] = Field({}, description="path (relative) -> base64 content, written first")
    fetch_files: list[str] = Field([], description="paths (relative) returned base64 after the run")
    args: list[str] = Field([], description="SandboxFusion's pytest arguments; unused here")


class CommandRunResult(BaseModel):
    """One step: how it ended, how long it took, its return code and its (capped) output."""

    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    """``POST /run_code``'s answer (always HTTP 200 once the body validated)."""

    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


def overall_status(steps: list[CommandRunResult]) -> tuple[RunStatus, str]:
    """SandboxFusion's rule for the top-level status from the steps that ran, with the message: a step
    in ``Error`` makes it a ``SandboxError`` carrying that step's stderr."""
    for step in steps:
        if step.status is CommandRunStatus.ERROR:
            return RunStatus.SANDBOX_ERROR, step.stderr or ""
    if any(step.status is CommandRunStatus.TIME_LIMIT_EXCEEDED for step in steps):
        return RunStatus.FAILED, ""
    if any(step.return_code not in (0, None) for step in steps):
        return RunStatus.FAILED, ""
    return RunStatus.SUCCESS, ""


def sandbox_error(message: str) -> RunCodeResponse:
    """A request the server could not serve (an unknown language, a bad path, a failed sandbox, ...)."""
    return RunCodeResponse(status=RunStatus.SANDBOX_ERROR, message=message)
