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
from typing import Any

from hybridflow.utils.reward_score.sandbox_fusion.utils import (
    API_TIMEOUT,
    INITIAL_RETRY_DELAY,
    MAX_RETRIES,
    SUPPORTED_LANGUAGES,
    classify_response,
    empty_metadata,
)
from hybridflow.workers.rollout.tools import limits
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


class SandboxFusionTool(BaseTool):
    """``code_interpreter`` over a SandboxFusion server (module docstring)."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | None = None) -> None:
        super().__init__(config or {}, tool_schema or ToolSchema.from_dict(SANDBOX_FUSION_TOOL_SCHEMA))
        self.sandbox_fusion_url = str(self.config.get("sandbox_fusion_url") or "")
        if not self.sandbox_fusion_url:
            raise ValueError("sandbox_fusion_url is not set (the server's .../run_code address)")
        self.limits = limits.from_config("sandbox_fusion", self.config, num_workers=10, rate_limit=10)
        self.default_timeout = float(self.config.get("default_timeout", 30))
        self.default_language = str(self.config.get("default_language", "python"))
        self.memory_limit_mb = int(self.config.get("memory_limit_mb", 1024))
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
        async with self.limits.hold():
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


def _timeout(value: Any, default: float) -> float:
    """The call's ``timeout`` argument if it is a positive number, else the tool's default."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return default
    return seconds if 0 < seconds < float("inf") else default
