"""verl's ``verl.tools.schemas``: the pydantic models a tool written for verl imports.

A verl tool imports ``OpenAIFunctionToolSchema`` (its constructor's schema) and ``ToolResponse`` (what its
``execute`` returns) from here, through the ``verl`` alias (:mod:`hybridflow.verl_compat`). The models
carry verl's fields:

- ``OpenAIFunctionToolSchema``: ``type``, ``function`` (an ``OpenAIFunctionSchema``: ``name``,
  ``description``, ``parameters``, ``strict``); ``parameters`` is an ``OpenAIFunctionParametersSchema``
  (``type``, ``properties`` of ``OpenAIFunctionPropertySchema``: ``type``, ``description``, ``enum``;
  ``required``);
- ``OpenAIFunctionParsedSchema`` (``name``, ``arguments`` as JSON text), ``OpenAIFunctionCallSchema``
  (``name``, ``arguments`` as a dict; :meth:`~OpenAIFunctionCallSchema.from_openai_function_parsed_schema`)
  and ``OpenAIFunctionToolCall`` (``id``, ``type``, ``function``);
- ``ToolResponse``: ``text``, ``image``, ``video`` (lists), all optional.

Our own tools take a :class:`~hybridflow.workers.rollout.tools.base_tool.ToolSchema`, which reads like an
``OpenAIFunctionToolSchema`` (``.type``, ``.function.name``, ``.model_dump()``), and may return a plain
string; the rollout takes a ``ToolResponse``'s ``text`` (:mod:`hybridflow.workers.rollout.multi_turn`).
pydantic is a core dependency (the agent loops' messages use it too), as in verl.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

__all__ = [
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
]


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter of a function."""

    type: str
    description: str | None = None
    enum: list[str] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """A function's parameters: a JSON-schema object."""

    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str]


def _no_parameters() -> OpenAIFunctionParametersSchema:
    return OpenAIFunctionParametersSchema(type="object", properties={}, required=[])


class OpenAIFunctionSchema(BaseModel):
    """A function: its name, description and parameters."""

    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=_no_parameters)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool as chat templates take it: ``{"type": "function", "function": {...}}``."""

    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as parsed from the model's text: the arguments still JSON text."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A call with its arguments decoded."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
        parsed_schema: OpenAIFunctionParsedSchema,
    ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """``(call, has_decode_error)``: arguments that are not JSON, or not a JSON object, become ``{}``
        with ``has_decode_error`` True."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    """A tool call with its id."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool's ``execute`` returns: text, and images or videos as lists (one item is ``[item]``)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_are_lists(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for key in ("image", "video"):
                if values.get(key) is not None and not isinstance(values[key], list):
                    raise ValueError(
                        f"{key} must be a list, got {type(values[key]).__name__}; wrap a single {key} in "
                        f"a list: ToolResponse({key}=[item]) (check the tool's execute())"
                    )
        return values

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video
