"""verl's ``SandboxFusionTool``: a code interpreter that runs the model's code on a SandboxFusion server.

Registered under verl's class path ``verl.tools.sandbox_fusion_tools.SandboxFusionTool``. Each call is
one ``POST`` of the code to ``sandbox_fusion_url`` (the full ``.../run_code`` address of ByteDance's
SandboxFusion, or of ``python -m hybridflow.sandbox serve``: docs/sandbox_fusion.md), with httpx.

Config keys (verl's): ``sandbox_fusion_url`` (required), ``num_workers`` (10: calls of this tool in
flight at once), ``rate_limit`` (10) with ``enable_global_rate_limit`` (true: calls in flight at once
over every SandboxFusionTool of this process; verl shares one limiter over the Ray cluster, here it is
per process, sized by the first tool that makes it), ``default_timeout`` (30 s: the compile and the
run timeout), ``default_language`` (``python``), ``memory_limit_mb`` (1024). A call's arguments may
override ``timeout`` and ``language``, as in verl.

The response text follows verl where the run finished: its stdout then its stderr, whatever the return
code. Anything else is a message saying what happened (verl answers ``"no stdout here"``): a timeout,
a compile error (with the compiler's output), a sandbox error, or a server that is down, too slow
(the HTTP timeout is both code timeouts plus ``API_TIMEOUT``), answering an HTTP error or junk. Such a
call fails alone: ``execute`` never raises, and ``metrics["error"]`` marks it as failed in the
rollout's tool counts (also for a run that exited non-zero), beside ``status``, ``exit_code`` and
``duration_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

from hybridflow.utils.reward_score.sandbox_fusion.utils import (
    API_TIMEOUT,
    INITIAL_RETRY_DELAY,
    MAX_RETRIES,
    SUPPORTED_LANGUAGES,
    classify_response,
    empty_metadata,
)
from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema

logger = logging.getLogger(__name__)

SANDBOX_FUSION_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "A tool for executing code.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to execute."}},
            "required": ["code"],
        },
    },
}
# the process-wide limiter of enable_global_rate_limit, one per event loop (asyncio primitives are)
_GLOBAL_LIMITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


class SandboxFusionTool(BaseTool):
    """``code_interpreter`` over a SandboxFusion server (module docstring)."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | None = None) -> None:
        super().__init__(config or {}, tool_schema or ToolSchema.from_dict(SANDBOX_FUSION_TOOL_SCHEMA))
        self.sandbox_fusion_url = str(self.config.get("sandbox_fusion_url") or "")
        if not self.sandbox_fusion_url:
            raise ValueError("sandbox_fusion_url is not set (the server's .../run_code address)")
        self.num_workers = _positive_int(self.config, "num_workers", 10)
        self.rate_limit = _positive_int(self.config, "rate_limit", 10)
        self.enable_global_rate_limit = bool(self.config.get("enable_global_rate_limit", True))
        self.default_timeout = float(self.config.get("default_timeout", 30))
        self.default_language = str(self.config.get("default_language", "python"))
        self.memory_limit_mb = int(self.config.get("memory_limit_mb", 1024))
        self._workers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs) -> str:
        instance_id = await super().create(instance_id)
        self._instances[instance_id] = {"ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[str, float, dict]:
        """Run ``parameters["code"]`` on the server; ``(text, 0.0, metrics)``, never raises."""
        if not isinstance(parameters, dict) or parameters.get("code") in (None, ""):
            return "Error: the 'code' argument is missing.", 0.0, {"error": "bad arguments"}
        code = parameters["code"] if isinstance(parameters["code"], str) else str(parameters["code"])
        timeout = _timeout(parameters.get("timeout"), self.default_timeout)
        language = str(parameters.get("language") or self.default_language)
        started = time.monotonic()
        async with self._limiter():
            response, error = await self._post(code, timeout, language)
        metrics: dict[str, Any] = {"duration_s": time.monotonic() - started}
        if error is not None:
            metrics.update(status="api_error", error="sandbox unavailable")
            text = f"Error: the sandbox at {self.sandbox_fusion_url} could not run the code: {error}"
            return text, 0.0, metrics
        return self._answer(response, timeout, metrics), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances.get(instance_id)
        return 0.0 if state is None else float(state["reward"])

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)

    def _limiter(self) -> _Limits:
        loop = asyncio.get_running_loop()
        if loop not in self._workers:
            self._workers[loop] = asyncio.Semaphore(self.num_workers)
        shared = None
        if self.enable_global_rate_limit:
            if loop not in _GLOBAL_LIMITERS:
                _GLOBAL_LIMITERS[loop] = asyncio.Semaphore(self.rate_limit)
            shared = _GLOBAL_LIMITERS[loop]
        return _Limits(self._workers[loop], shared)

    async def _post(self, code: str, timeout: float, language: str) -> tuple[dict | None, str | None]:
        """One run on the server, retried on HTTP 504 as verl's client does; ``(json, None)`` or
        ``(None, why)``."""
        if language not in SUPPORTED_LANGUAGES:
            return None, f"unsupported language {language!r}"
        import httpx

        payload = {
            "code": code,
            "language": language,
            "stdin": None,
            "compile_timeout": timeout,
            "run_timeout": timeout,
            "memory_limit_MB": self.memory_limit_mb,
            "files": {},
            "fetch_files": [],
        }
        try:
            async with httpx.AsyncClient(timeout=2 * timeout + API_TIMEOUT) as client:
                for attempt in range(1, MAX_RETRIES + 1):
                    response = await client.post(self.sandbox_fusion_url, json=payload)
                    if response.status_code != 504:
                        break
                    if attempt < MAX_RETRIES:
                        await asyncio.sleep(INITIAL_RETRY_DELAY * attempt)
        except httpx.TimeoutException:
            return None, f"no answer within {2 * timeout + API_TIMEOUT:g}s"
        except httpx.HTTPError as error:
            return None, f"{type(error).__name__}: {error}"
        except Exception as error:  # e.g. a URL httpx cannot parse
            return None, f"{type(error).__name__}: {error}"
        if response.status_code >= 400:
            return None, f"HTTP {response.status_code}: {response.text[:200]}"
        try:
            data = response.json()
        except ValueError:
            return None, f"the answer is not JSON: {response.text[:200]!r}"
        if not isinstance(data, dict) or "status" not in data:
            return None, f"the answer is not a SandboxFusion response: {response.text[:200]!r}"
        return data, None

    def _answer(self, response: dict, timeout: float, metrics: dict[str, Any]) -> str:
        """The tool's text for a server response, filling ``metrics``."""
        details = empty_metadata(0, None, None)
        classify_response(response, None, details)
        status, run_status = details["status"], details["run_status"]
        metrics.update(status=status, exit_code=details["exit_code"])
        if status == "sandbox_error":
            metrics["error"] = "sandbox error"
            return f"Error: the sandbox could not run the code: {response.get('message') or 'no message'}"
        if status in ("compile_error", "compile_timeout"):
            metrics["error"] = status.replace("_", " ")
            return f"{details['compile_stderr'] or ''}[{metrics['error']}]"
        output = str(details["stdout"] or "") + str(details["stderr"] or "")
        if run_status == "Finished":
            if details["exit_code"] != 0:
                metrics["error"] = f"exit code {details['exit_code']}"
            return output
        if run_status == "TimeLimitExceeded":
            metrics["error"] = "timeout"
            return f"{output}[timed out after {timeout:g}s]"
        metrics["error"] = status or "unknown"
        return f"Error: unexpected sandbox response (status {response.get('status')!r})"


class _Limits:
    """Enters this tool's ``num_workers`` semaphore, then the process-wide one (if any)."""

    def __init__(self, own: asyncio.Semaphore, shared: asyncio.Semaphore | None) -> None:
        self.own, self.shared = own, shared

    async def __aenter__(self) -> None:
        await self.own.acquire()
        if self.shared is not None:
            try:
                await self.shared.acquire()
            except BaseException:
                self.own.release()
                raise

    async def __aexit__(self, *exc_info) -> None:
        if self.shared is not None:
            self.shared.release()
        self.own.release()


def _positive_int(config: dict[str, Any], key: str, default: int) -> int:
    value = int(config.get(key, default))
    if value < 1:
        raise ValueError(f"{key} must be at least 1, got {value}")
    return value


def _timeout(value: Any, default: float) -> float:
    """The call's ``timeout`` argument if it is a positive number, else the tool's default."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return default
    return seconds if 0 < seconds < float("inf") else default
