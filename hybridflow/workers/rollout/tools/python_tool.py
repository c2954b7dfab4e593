"""A code-interpreter tool: runs the model's Python in :mod:`~hybridflow.utils.sandbox`.

Tool config keys (all optional) mirror :class:`~hybridflow.utils.sandbox.SandboxLimits`:
``wall_timeout_s``, ``cpu_time_s``, ``memory_mb``, ``max_processes``, ``max_output_bytes``,
``max_file_bytes``, ``max_open_files``, ``max_disk_mb``, ``use_network_namespace``,
``drop_privileges``, ``import_site_packages``; plus ``work_root``, where each call's small host directory
(the code and two mount points, never visible to the code) goes.
verl's ``default_timeout`` and ``memory_limit_mb`` are read as ``wall_timeout_s`` and ``memory_mb``.
Each :meth:`PythonTool.execute` call is a fresh process: nothing carries over between calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridflow.utils.sandbox import SandboxLimits, SandboxResult, run_python
from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema

PYTHON_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": (
            "Run a self-contained Python 3 script and return what it prints (stdout, then stderr). "
            "Only the standard library is available, there is no network, and nothing persists between "
            "calls. Use print() to see results."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python source code to run."}},
            "required": ["code"],
        },
    },
}
_LIMIT_NAMES = [limit_field.name for limit_field in dataclasses.fields(SandboxLimits)]
# verl's SandboxFusionTool config keys that mean the same here -> our names
VERL_CONFIG_ALIASES = {"default_timeout": "wall_timeout_s", "memory_limit_mb": "memory_mb"}


def limits_from_config(config: dict[str, Any]) -> SandboxLimits:
    """:class:`SandboxLimits` with every field the config names overridden (unknown keys are ignored)."""
    config = {
        **{ours: config[verl] for verl, ours in VERL_CONFIG_ALIASES.items() if verl in config},
        **config,
    }
    defaults = SandboxLimits()
    overrides = {}
    for name in _LIMIT_NAMES:
        if config.get(name) is not None:
            overrides[name] = type(getattr(defaults, name))(config[name])
    return dataclasses.replace(defaults, **overrides)


def format_response(result: SandboxResult, wall_timeout_s: float) -> str:
    """stdout, then stderr, then one bracketed line about how the run ended when that is worth saying."""
    parts = [text.rstrip("\n") for text in (result.stdout, result.stderr) if text.strip()]
    if result.timed_out:
        parts.append(f"[timed out after {wall_timeout_s}s]")
    elif result.killed_reason is not None:
        parts.append(f"[killed: {result.killed_reason}]")
    elif result.exit_code not in (0, None):
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"


class PythonTool(BaseTool):
    """``code_interpreter``: each call runs ``parameters["code"]`` in a fresh sandboxed process."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | None = None) -> None:
        super().__init__(config or {}, tool_schema or ToolSchema.from_dict(PYTHON_TOOL_SCHEMA))
        self.limits = limits_from_config(self.config)
        self.work_root = self.config.get("work_root")

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[str, float, dict]:
        """Returns ``(response_text, 0.0, metrics)``; never raises. ``metrics["error"]`` is set (the call
        failed) for bad arguments and for code that did not run to a clean exit: an exception, a
        non-zero exit, a timeout, a limit hit, or a sandbox that could not start."""
        problem = _code_problem(parameters.get("code") if isinstance(parameters, dict) else None)
        if problem is not None:
            return f"Error: the 'code' argument {problem}.", 0.0, {"error": "bad arguments"}
        result = await run_python(parameters["code"], self.limits, work_root=self.work_root)
        metrics = {
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "killed_reason": result.killed_reason,
            "duration_s": result.duration_s,
        }
        if result.timed_out or result.killed_reason is not None or result.exit_code != 0:
            metrics["error"] = result.killed_reason or f"exit code {result.exit_code}"
        return format_response(result, self.limits.wall_timeout_s), 0.0, metrics


def _code_problem(code: Any) -> str | None:
    """Why ``code`` cannot be run (completing "the 'code' argument ..."), or None."""
    if not isinstance(code, str):
        return "is missing" if code is None else f"must be a string, got {type(code).__name__}"
    if not code.strip():
        return "is empty"
    try:
        code.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate, e.g. from a JSON "\udc80" escape
        return f"is not valid Unicode (a lone surrogate at character {error.start})"
    return None
