"""The tool interface for multi-turn rollouts (verl's ``BaseTool`` contract).

A tool is configured once (``config`` from the tool YAML, plus its OpenAI function schema) and then
serves many rollout samples at the same time: each sample gets its own instance id from
:meth:`BaseTool.create`, calls :meth:`BaseTool.execute` any number of times, may be scored with
:meth:`BaseTool.calc_reward`, and is cleaned up with :meth:`BaseTool.release`. ``execute`` never raises
for bad model input: it returns an error message as the tool's response instead, with
``metrics["error"]`` set so the call counts as failed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolSchema:
    """An OpenAI function-tool schema:
    ``{"type": "function", "function": {name, description, parameters}}``."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}, "required": []}
    )

    @classmethod
    def from_dict(cls, schema: dict[str, Any]) -> ToolSchema:
        if hasattr(schema, "model_dump"):  # verl's OpenAIFunctionToolSchema (a pydantic model)
            schema = schema.model_dump(exclude_none=True)
        function = schema.get("function", schema)
        if "name" not in function:
            raise ValueError(f"tool schema has no function name: {schema!r}")
        return cls(
            name=str(function["name"]),
            description=str(function.get("description", "")),
            parameters=dict(
                function.get("parameters") or {"type": "object", "properties": {}, "required": []}
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """The form chat templates take in ``tools=[...]``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @property
    def required(self) -> list[str]:
        return list(self.parameters.get("required", []))

    # verl's OpenAIFunctionToolSchema reads, for tools written for verl (``self.tool_schema.function.name``)
    @property
    def type(self) -> str:
        return "function"

    @property
    def function(self):
        """This schema's function as verl's ``OpenAIFunctionSchema`` (needs pydantic)."""
        from hybridflow.workers.rollout.tools.schemas import OpenAIFunctionSchema

        return OpenAIFunctionSchema.model_validate(self.to_dict()["function"])

    def model_dump(self, **kwargs) -> dict[str, Any]:
        """verl's ``tool_schema.model_dump(...)``: the dict of :meth:`to_dict` (keyword options ignored)."""
        return self.to_dict()


class BaseTool:
    """Subclass and override :meth:`execute` (and :meth:`create`/:meth:`calc_reward`/:meth:`release`
    when the tool keeps per-sample state)."""

    def __init__(self, config: dict[str, Any], tool_schema: ToolSchema) -> None:
        self.config = dict(config or {})
        if not isinstance(tool_schema, ToolSchema):  # a dict, or verl's OpenAIFunctionToolSchema
            tool_schema = ToolSchema.from_dict(tool_schema)
        self.tool_schema = tool_schema
        self.name = tool_schema.name

    def get_openai_tool_schema(self) -> dict[str, Any]:
        return self.tool_schema.to_dict()

    async def create(self, instance_id: str | None = None, **kwargs) -> str:
        """Start a per-sample instance; ``kwargs`` come from
        ``extra_info.tools_kwargs[name].create_kwargs``."""
        return instance_id or str(uuid.uuid4())

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[str, float, dict]:
        """Run one call; returns ``(response_text, step_reward, metrics)``. A truthy
        ``metrics["error"]`` (a short reason) marks the call as failed in the rollout's counts."""
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None

    def missing_arguments(self, parameters: dict[str, Any]) -> list[str]:
        """Required schema arguments absent from ``parameters`` (for clear error responses)."""
        return [name for name in self.tool_schema.required if name not in parameters]
