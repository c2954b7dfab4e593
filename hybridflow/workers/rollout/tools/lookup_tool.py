"""``lookup``: returns the value stored for a sample, after that sample's latency.

It stands in for a retrieval or search API (verl's ``SearchTool`` calls a retrieval server): what the
rollout sees is a call that returns a short text after a wait that varies from sample to sample. The
per-sample value and latency come from ``extra_info.tools_kwargs.lookup.create_kwargs``
(``{"value": "pear", "latency_s": 0.4}``); the wait is an ``asyncio.sleep``, so other conversations
keep generating meanwhile, as they would while a real request is out. Used by
``benchmarks/long_tail.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema


class LookupTool(BaseTool):
    """Config keys (optional): ``default_latency_s`` (for samples whose kwargs give none, 0)."""

    def __init__(self, config: dict[str, Any], tool_schema: ToolSchema) -> None:
        super().__init__(config, tool_schema)
        self.default_latency_s = float(self.config.get("default_latency_s", 0.0))
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(
        self, instance_id: str | None = None, value: Any = None, latency_s: float | None = None, **kwargs
    ) -> str:
        instance_id = await super().create(instance_id)
        latency = self.default_latency_s if latency_s is None else float(latency_s)
        self._instances[instance_id] = {"value": value, "latency_s": max(latency, 0.0), "calls": 0}
        return instance_id

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[str, float, dict]:
        """``("value: <value>", 0.0, {})`` after the instance's latency; an unknown instance or a
        sample without a value is an error response."""
        state = self._instances.get(instance_id)
        if state is None:
            return (
                f"Error: unknown instance id {instance_id!r} for tool {self.name!r}.",
                0.0,
                {"error": "unknown instance"},
            )
        await asyncio.sleep(state["latency_s"])
        state["calls"] += 1
        if state["value"] is None:
            return "Error: nothing stored for this sample.", 0.0, {"error": "no value"}
        return f"value: {state['value']}", 0.0, {}

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)
