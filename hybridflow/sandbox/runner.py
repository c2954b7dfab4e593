"""One ``/run_code`` request: check it, run the driver in a fresh sandbox, turn its report into the response.

The request's code never runs in the server's process. :func:`run_code` validates what the server can
decide alone (the language, the timeouts, the file paths, the size), then runs ``_driver.py`` plus the
job in :func:`hybridflow.utils.sandbox.run_python` with limits derived from the request
and the :class:`ServerLimits`:

* wall clock: the compile and run timeouts (each capped at ``max_timeout_s``) plus ``SETUP_SLACK_S`` for
  the whole sandbox; each step is held to its own timeout by the driver (TimeLimitExceeded);
* memory: RLIMIT_AS of ``memory_limit_MB`` for each step (``<= 0`` or above ``max_memory_mb``: the cap);
* output: ``output_limit_bytes`` kept of each step's stdout and of its stderr (SandboxFusion keeps 1 MiB);
* files: ``max_file_mb`` per file written (and for the request's code, stdin and files together),
  ``max_disk_mb`` for everything the run writes, ``max_fetch_mb`` for the files returned;
* processes: ``max_processes``; no network; the sandbox's own filesystem, so nothing outside
  ``/sandbox`` of that run is readable or writable.

Anything that goes wrong on the server's side (a sandbox that could not start, a driver that died, a
report that does not parse) is a ``SandboxError`` response with a message; the server keeps serving.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from hybridflow.sandbox.api import (
    CommandRunResult,
    RunCodeRequest,
    RunCodeResponse,
    overall_status,
    sandbox_error,
)
from hybridflow.sandbox.languages import LANGUAGES, commands_for, unavailable_reason
from hybridflow.utils.sandbox import SandboxLimits, SandboxResult, run_python

DRIVER_SOURCE = (Path(__file__).parent / "_driver.py").read_text(encoding="utf-8")
SETUP_SLACK_S = 10.0  # the sandbox's own start and the driver's work around the steps
DRIVER_MEMORY_MB = 256  # the driver's own address space at least (steps get the request's limit)
MIB = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    """The server's caps (``python -m hybridflow.sandbox serve`` flags of the same names)."""

    max_timeout_s: float = 300.0
    max_memory_mb: int = 4096
    output_limit_bytes: int = MIB
    max_file_mb: int = 16
    max_disk_mb: int = 256
    max_fetch_mb: int = 16
    max_processes: int = 64
    site_packages: bool = False  # let Python code import the server's installed packages
    work_root: str | None = None  # where each run's small host directory goes (default: the temp dir)


async def run_code(request: RunCodeRequest, limits: ServerLimits) -> RunCodeResponse:
    """Serve one request; never raises for anything the request or its code does."""
    problem = request_problem(request, limits)
    if problem is not None:
        return sandbox_error(problem)
    nonce = secrets.token_hex(16)
    source = driver_program(request, limits, nonce)
    sandbox_limits = sandbox_limits_for(request, limits)
    if len(source.encode("utf-8")) > sandbox_limits.max_file_bytes:
        return sandbox_error(
            f"the request is too large: its code, stdin and files come to more than the server's "
            f"--max-file-mb={limits.max_file_mb}"
        )
    result = await run_python(source, sandbox_limits, work_root=limits.work_root)
    return response_from(result, nonce)


def request_problem(request: RunCodeRequest, limits: ServerLimits) -> str | None:
    """Why the server refuses ``request`` before running anything (None: it runs it)."""
    reason = unavailable_reason(request.language)
    if reason is not None:
        return reason
    for name in ("compile_timeout", "run_timeout"):
        value = getattr(request, name)
        if not math.isfinite(value) or value <= 0:
            return f"{name} must be a positive number of seconds, got {value}"
    for name, content in request.files.items():
        if not _relative_inside(name):
            return f"file path {name!r} must be relative and stay inside the run's directory"
        if content is not None:
            try:
                base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError):
                return f"files[{name!r}] is not valid base64"
    for name in request.fetch_files:
        if not _relative_inside(name):
            return f"fetch_files entry {name!r} must be relative and stay inside the run's directory"
    return None


def _relative_inside(name: str) -> bool:
    if not name or "\0" in name or os.path.isabs(name):
        return False
    normal = os.path.normpath(name)
    return normal != "." and not normal.startswith("..")


def step_memory_mb(request: RunCodeRequest, limits: ServerLimits) -> int:
    """The address-space limit of each step, in MiB."""
    asked = request.memory_limit_MB
    return limits.max_memory_mb if asked <= 0 else min(asked, limits.max_memory_mb)


def driver_program(request: RunCodeRequest, limits: ServerLimits, nonce: str) -> str:
    """The sandbox's ``main.py``: the driver, then the call that hands it this request's job."""
    language = LANGUAGES[request.language]
    compile_argv, run_argv = commands_for(language)
    environment = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/sandbox",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    if limits.site_packages:
        import site

        environment["PYTHONPATH"] = os.pathsep.join(site.getsitepackages())
    job = {
        "nonce": nonce,
        "source": language.source,
        "code": request.code,
        "compile": compile_argv,
        "run": run_argv,
        "stdin": request.stdin,
        "compile_timeout": min(request.compile_timeout, limits.max_timeout_s),
        "run_timeout": min(request.run_timeout, limits.max_timeout_s),
        "memory_bytes": step_memory_mb(request, limits) * MIB,
        "output_limit": limits.output_limit_bytes,
        "fetch_limit": limits.max_fetch_mb * MIB,
        "files": request.files,
        "fetch_files": request.fetch_files,
        "env": environment,
    }
    encoded = base64.b64encode(json.dumps(job).encode("utf-8")).decode("ascii")
    return f'{DRIVER_SOURCE}\n\nmain("{encoded}")\n'


def sandbox_limits_for(request: RunCodeRequest, limits: ServerLimits) -> SandboxLimits:
    """The sandbox's limits for the whole run (the driver narrows them per step)."""
    compiled = LANGUAGES[request.language].compile is not None
    steps_s = min(request.run_timeout, limits.max_timeout_s)
    if compiled:
        steps_s += min(request.compile_timeout, limits.max_timeout_s)
    # the report carries both steps' output and the fetched files, base64-encoded (4/3), plus framing
    report_bytes = (4 * limits.output_limit_bytes + limits.max_fetch_mb * MIB) * 4 // 3 + 64 * 1024
    return SandboxLimits(
        wall_timeout_s=steps_s + SETUP_SLACK_S,
        cpu_time_s=int(math.ceil(steps_s)) + 2,
        memory_mb=max(step_memory_mb(request, limits), DRIVER_MEMORY_MB),
        max_processes=limits.max_processes,
        max_output_bytes=report_bytes,
        max_file_bytes=limits.max_file_mb * MIB,
        max_disk_mb=limits.max_disk_mb,
        use_network_namespace=True,
        drop_privileges=True,
        import_site_packages=limits.site_packages,
    )


def response_from(result: SandboxResult, nonce: str) -> RunCodeResponse:
    """The response for the driver's report in ``result``; a missing or broken report is a SandboxError."""
    report = _find_report(result.stdout, nonce)
    if report is None:
        return sandbox_error(_no_report_message(result))
    if report.get("error"):
        return sandbox_error(f"the sandbox could not run the request: {report['error']}")
    try:
        compile_result = _step(report.get("compile"))
        run_result = _step(report.get("run"))
        files = {str(name): str(content) for name, content in (report.get("files") or {}).items()}
    except (TypeError, ValueError, KeyError, AttributeError, binascii.Error) as error:
        return sandbox_error(f"the sandbox's report is malformed: {error}")
    status, message = overall_status([step for step in (compile_result, run_result) if step is not None])
    skipped = report.get("skipped_files") or []
    if skipped and not message:
        message = f"not returned (not a regular file, or over --max-fetch-mb): {', '.join(map(str, skipped))}"
    return RunCodeResponse(
        status=status, message=message, compile_result=compile_result, run_result=run_result, files=files
    )


def _find_report(stdout: str, nonce: str) -> dict | None:
    frame = f"\x1e{nonce}\x1e"
    start = stdout.find(frame)
    if start < 0:
        return None
    end = stdout.find(frame, start + len(frame))
    if end < 0:
        return None
    try:
        report = json.loads(stdout[start + len(frame) : end])
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _step(raw: dict | None) -> CommandRunResult | None:
    if raw is None:
        return None

    def decode(field: str) -> str:
        return base64.b64decode(raw[field], validate=True).decode("utf-8", errors="replace")

    return CommandRunResult(
        status=raw["status"],
        execution_time=raw["execution_time"],
        return_code=raw["return_code"],
        stdout=decode("stdout"),
        stderr=decode("stderr"),
    )


def _no_report_message(result: SandboxResult) -> str:
    if result.killed_reason == "sandbox setup failed":
        return f"the sandbox could not start: {result.isolation.get('error') or result.stderr.strip()}"
    how = result.killed_reason or f"exit code {result.exit_code}"
    tail = result.stderr.strip()[-800:]
    return f"the sandbox ended without a report ({how})" + (f": {tail}" if tail else "")
