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

An entry with ``config.type: mcp`` (verl's ``ToolType.MCP``) has no ``tool_schema``: its ``mcp`` section
names verl's ``mcp_server.json`` (``mcp_servers_config_path``, relative to the working directory as in
verl, else to the tool YAML's folder) and optionally ``tool_selected_list``; it becomes one tool per tool
the servers list (:mod:`~hybridflow.workers.rollout.tools.mcp_client`). :func:`check_tool_config` checks
a file without building a tool or calling a server (the trainer's config check, before Ray starts).
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
    # fastmcp clients of the servers in mcp_servers_config_path
    "verl.tools.mcp_base_tool.MCPBaseTool": "hybridflow.workers.rollout.tools.mcp_base_tool.MCPBaseTool",
    "verl.tools.mcp_search_tool.MCPSearchTool": (
        "hybridflow.workers.rollout.tools.mcp_search_tool.MCPSearchTool"
    ),
}
TOOL_TYPES = ("native", "mcp")  # verl's ToolType values of config.type


class ToolConfigError(ValueError):
    """A tool YAML that cannot be loaded; the message names the file and the entry index."""


def load_tools(path: str) -> dict[str, BaseTool]:
    """Instantiate every tool in the YAML at ``path``, keyed by its schema's function name."""
    entries = _read_entries(path)
    tools: dict[str, BaseTool] = {}
    for index, entry in enumerate(entries):
        where = f"{path}: tools[{index}]"
        for tool in _build_tools(entry, where, path):
            if tool.name in tools:
                raise ToolConfigError(
                    f"{where}: duplicate tool name {tool.name!r} (already defined by "
                    f"{type(tools[tool.name]).__qualname__}); tool names must be unique"
                )
            tools[tool.name] = tool
    return tools


def check_tool_config(path: str) -> None:
    """Raise ``ToolConfigError`` for what :func:`load_tools` would refuse before building a tool: the
    file, each entry's keys, its class (imported), its schema, an MCP entry's servers file. Builds no
    tool and contacts no server."""
    for index, entry in enumerate(_read_entries(path)):
        where = f"{path}: tools[{index}]"
        _check_entry(entry, where)
        if _tool_type(entry, where) == "mcp":
            _mcp_servers_path(entry, where, path)
        else:
            _schema_of(entry, where)


def tool_schemas(tools: Mapping[str, BaseTool] | Iterable[BaseTool]) -> list[dict[str, Any]]:
    """OpenAI function schemas of ``tools`` (a ``load_tools`` dict or a list) for chat templates."""
    values = tools.values() if isinstance(tools, Mapping) else tools
    return [_schema_dict(tool.get_openai_tool_schema()) for tool in values]


def _schema_dict(schema: Any) -> dict[str, Any]:
    """A tool's schema as a dict: a verl tool's ``get_openai_tool_schema`` returns a schema object (its
    ``tool_schema``: our ToolSchema, or verl's pydantic ``OpenAIFunctionToolSchema``), as verl's does."""
    return schema if isinstance(schema, dict) else ToolSchema.from_dict(schema).to_dict()


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


def _check_entry(entry: Any, where: str) -> tuple[type[BaseTool], dict]:
    """The entry's class and ``config``, or ``ToolConfigError``."""
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: each entry must be a mapping, got {type(entry).__name__}")
    if entry.get("class_name") in (None, ""):
        raise ToolConfigError(f"{where}: missing required key 'class_name'")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: 'config' must be a mapping, got {type(config).__name__}")
    try:
        cls = resolve_tool_class(entry["class_name"])
    except ToolConfigError as exc:
        raise ToolConfigError(f"{where}: {exc}") from exc.__cause__
    return cls, config


def _tool_type(entry: dict, where: str) -> str:
    tool_type = str((entry.get("config") or {}).get("type", "native"))
    if tool_type not in TOOL_TYPES:
        raise ToolConfigError(f"{where}: config.type must be one of {list(TOOL_TYPES)}, got {tool_type!r}")
    return tool_type


def _schema_of(entry: dict, where: str) -> ToolSchema:
    if entry.get("tool_schema") in (None, ""):
        raise ToolConfigError(f"{where}: missing required key 'tool_schema'")
    if not isinstance(entry["tool_schema"], dict):
        raise ToolConfigError(
            f"{where}: 'tool_schema' must be a mapping, got {type(entry['tool_schema']).__name__}"
        )
    try:
        return ToolSchema.from_dict(entry["tool_schema"])
    except (ValueError, TypeError, AttributeError) as exc:
        raise ToolConfigError(f"{where}: invalid tool_schema: {exc}") from exc


def _mcp_servers_path(entry: dict, where: str, yaml_path: str) -> str:
    """The entry's ``mcp.mcp_servers_config_path``: as written when that exists (from the working
    directory, verl's rule), else beside the tool YAML."""
    mcp = entry.get("mcp")
    if not isinstance(mcp, dict) or not mcp.get("mcp_servers_config_path"):
        raise ToolConfigError(
            f"{where}: config.type mcp needs an 'mcp:' section with mcp_servers_config_path"
        )
    selected = mcp.get("tool_selected_list")
    if selected is not None and not (
        isinstance(selected, list) and all(isinstance(name, str) for name in selected)
    ):
        raise ToolConfigError(f"{where}: mcp.tool_selected_list must be a list of tool names")
    written = os.path.expanduser(str(mcp["mcp_servers_config_path"]))
    beside = os.path.join(os.path.dirname(os.path.abspath(yaml_path)), written)
    for candidate in (written, beside):
        if os.path.isfile(candidate):
            return candidate
    raise ToolConfigError(f"{where}: mcp.mcp_servers_config_path {written!r} is not a file")


def _build_tools(entry: Any, where: str, yaml_path: str) -> list[BaseTool]:
    cls, config = _check_entry(entry, where)
    if _tool_type(entry, where) == "mcp":
        servers = _mcp_servers_path(entry, where, yaml_path)
        from hybridflow.workers.rollout.tools.mcp_client import load_mcp_tools

        try:
            return load_mcp_tools(cls, entry, config_path=servers)
        except Exception as exc:
            raise ToolConfigError(f"{where}: MCP tools of {servers}: {_reason(exc)}") from exc
    schema = _schema_of(entry, where)
    try:
        return [cls(config, schema)]
    except Exception as exc:
        raise ToolConfigError(f"{where}: constructing {cls.__qualname__} failed: {exc}") from exc


def _reason(error: BaseException) -> str:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    if isinstance(error, TimeoutError):
        return "no answer within the entry's timeout (config.timeout)"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
