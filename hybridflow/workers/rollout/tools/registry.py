"""Load the tools of a multi-turn rollout from a verl-style tool YAML.

The file is the one named by ``actor_rollout_ref.rollout.multi_turn.tool_config_path``::

    tools:
      - class_name: "hybridflow.workers.rollout.tools.gsm8k_tool.Gsm8kTool"
        config: {type: native}
        tool_schema:
          type: "function"
          function: {name: "calc_gsm8k_reward", description: "...", parameters: {...}}

Each entry's class is imported from its dotted path, must subclass :class:`BaseTool`, and is built as
``cls(config, ToolSchema.from_dict(tool_schema))``. verl's own class paths for the tools this project
ships are accepted too (see :data:`VERL_CLASS_ALIASES`), so verl tool configs load unchanged.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import OmegaConf

from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema

# verl class path -> the equivalent class here. Resolved (imported) only when a config names it.
VERL_CLASS_ALIASES: dict[str, str] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "hybridflow.workers.rollout.tools.gsm8k_tool.Gsm8kTool",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": (
        "hybridflow.workers.rollout.tools.sandbox_fusion_tool.SandboxFusionTool"  # an HTTP client of its URL
    ),
    "verl.tools.search_tool.SearchTool": (
        "hybridflow.workers.rollout.tools.search_tool.SearchTool"  # an HTTP client of retrieval_service_url
    ),
}


class ToolConfigError(ValueError):
    """A tool YAML that cannot be loaded; the message names the file and the entry index."""


def load_tools(path: str) -> dict[str, BaseTool]:
    """Instantiate every tool in the YAML at ``path``, keyed by its schema's function name."""
    entries = _read_entries(path)
    tools: dict[str, BaseTool] = {}
    for index, entry in enumerate(entries):
        where = f"{path}: tools[{index}]"
        tool = _build_tool(entry, where)
        if tool.name in tools:
            raise ToolConfigError(
                f"{where}: duplicate tool name {tool.name!r} (already defined by "
                f"{type(tools[tool.name]).__qualname__}); tool names must be unique"
            )
        tools[tool.name] = tool
    return tools


def tool_schemas(tools: Mapping[str, BaseTool] | Iterable[BaseTool]) -> list[dict[str, Any]]:
    """OpenAI function schemas of ``tools`` (a ``load_tools`` dict or a list) for chat templates."""
    values = tools.values() if isinstance(tools, Mapping) else tools
    return [tool.get_openai_tool_schema() for tool in values]


def resolve_tool_class(class_name: str) -> type[BaseTool]:
    """Import the :class:`BaseTool` subclass at dotted path ``class_name`` (verl aliases allowed).

    Raises ``ToolConfigError`` (without file context) when it cannot be imported or is no tool.
    """
    if not isinstance(class_name, str) or not class_name.strip():
        raise ToolConfigError(f"class_name must be a non-empty string, got {class_name!r}")
    class_name = class_name.strip()
    target = VERL_CLASS_ALIASES.get(class_name, class_name)
    if target.startswith("verl."):
        raise ToolConfigError(
            f"class_name {class_name!r} is a verl tool with no counterpart here; "
            f"supported verl tools: {', '.join(sorted(VERL_CLASS_ALIASES))}"
        )
    module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ToolConfigError(f"class_name {class_name!r} must be a dotted path 'package.module.ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolConfigError(
            f"cannot import module {module_name!r} for class_name {class_name!r}: {exc}"
        ) from exc
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise ToolConfigError(
            f"module {module_name!r} has no attribute {attr!r} (class_name {class_name!r})"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ToolConfigError(f"class_name {class_name!r} is {cls!r}, not a subclass of BaseTool")
    return cls


def _read_entries(path: str) -> list[Any]:
    """The ``tools`` list of the YAML file, as plain Python containers."""
    if not path or not os.path.isfile(path):
        raise ToolConfigError(f"tool config file not found: {path!r}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:  # yaml.YAMLError, interpolation errors, a top-level list, ...
        raise ToolConfigError(f"{path}: cannot read tool config: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(f"{path}: expected a top-level 'tools:' list of tool entries")
    return data["tools"]


def _build_tool(entry: Any, where: str) -> BaseTool:
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: each entry must be a mapping, got {type(entry).__name__}")
    for key in ("class_name", "tool_schema"):
        if entry.get(key) in (None, ""):
            raise ToolConfigError(f"{where}: missing required key {key!r}")
    try:
        cls = resolve_tool_class(entry["class_name"])
    except ToolConfigError as exc:
        raise ToolConfigError(f"{where}: {exc}") from exc.__cause__
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: 'config' must be a mapping, got {type(config).__name__}")
    if not isinstance(entry["tool_schema"], dict):
        raise ToolConfigError(
            f"{where}: 'tool_schema' must be a mapping, got {type(entry['tool_schema']).__name__}"
        )
    try:
        schema = ToolSchema.from_dict(entry["tool_schema"])
    except (ValueError, TypeError, AttributeError) as exc:
        raise ToolConfigError(f"{where}: invalid tool_schema: {exc}") from exc
    try:
        return cls(config, schema)
    except Exception as exc:
        raise ToolConfigError(f"{where}: constructing {cls.__qualname__} failed: {exc}") from exc
