"""A tool written for verl, as its users write one: verl's imports (``verl.tools.base_tool``,
``verl.tools.schemas``), verl's signatures (``create`` returns ``(instance_id, ToolResponse)``,
``execute`` a ``ToolResponse``), the schema read as verl's ``OpenAIFunctionToolSchema``. It runs unchanged
on hybridflow through the verl alias (``tests/workers/rollout/test_multi_turn.py``)."""

from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class MultiplyTool(BaseTool):
    """``a * b``; step reward 0.25 a call; ``calc_reward``: 1.0 when the last product is the sample's
    ``create_kwargs["expected"]``."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict[str, Any]] = {}
        self.described = f"{self.tool_schema.function.name}: {self.tool_schema.function.description}"
        self.released: list[str] = []

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, expected: Any = None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"expected": expected, "last": None}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        product = int(parameters["a"]) * int(parameters["b"])
        self._instance_dict[instance_id]["last"] = product
        return ToolResponse(text=f"product={product}"), 0.25, {"calls": 1}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return 1.0 if state["last"] is not None and str(state["last"]) == str(state["expected"]) else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self.released.append(instance_id)
        self._instance_dict.pop(instance_id, None)
