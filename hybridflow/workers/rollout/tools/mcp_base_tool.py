"""verl's ``MCPBaseTool``: a tool served by an MCP server, called through ``fastmcp``.

Registered under verl's class path ``verl.tools.mcp_base_tool.MCPBaseTool``. Configured as verl configures
it, by a tool YAML entry with ``config.type: mcp`` and no ``tool_schema``: the registry reads the
entry's ``mcp.mcp_servers_config_path`` (verl's ``mcp_server.json``), lists the servers' tools (those in
``mcp.tool_selected_list`` when given) and builds one tool per listed tool, its schema the server's
(:mod:`~hybridflow.workers.rollout.tools.mcp_client`)::

    tools:
      - class_name: verl.tools.mcp_search_tool.MCPSearchTool
        config: {rate_limit: 120, timeout: 120, type: mcp}
        mcp:
          mcp_servers_config_path: ./mcp_server.json
          tool_selected_list: [tavily_search_tool]

A call sends the model's arguments to the server as they are and answers the text parts of the result,
joined by spaces (verl's). A server that is down, too slow (``timeout``, verl's default 30 s, bounds the
connection and the call), refuses the token or answers junk costs this call alone: ``execute`` never
raises; the text says what happened (verl's ``"\\n Tool call failed: ..."``, ``"\\n Connection failed:
..."``, ``"\\n An unexpected error occurred: ..."``) and ``metrics["error"]`` marks the call as failed in
the rollout's tool counts, as does a result the server flags as an error (``isError``). The metrics are
verl's (``query_count``, ``status``, ``total_results``, ``api_request_error``). The tool gives no reward
(``calc_reward`` is 0.0; verl's returns the texts received, which no reward sums); the texts are kept per
instance in :meth:`MCPBaseTool.responses`.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema

# fastmcp through mcp_client, whose import says which extra brings it when it is missing
from hybridflow.workers.rollout.tools.mcp_client import ClientError, ClientManager

logger = logging.getLogger(__name__)


class MCPBaseTool(BaseTool):
    """An MCP server's tool (module docstring). Subclasses parse results in :meth:`_parse_tool_result`."""

    def __init__(self, config: dict[str, Any], tool_schema: ToolSchema) -> None:
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict[str, Any]] = {}
        self.timeout = float(self.config.get("timeout", 30))
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout}")

    async def create(self, instance_id: str | None = None, **kwargs) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._instance_dict[instance_id] = {"response": "", "reward": []}
        return instance_id

    async def _call_tool(self, instance_id: str, parameters: dict[str, Any]) -> tuple[str, dict]:
        """``(text, metadata)`` of one call; an error is the text (verl's words) and
        ``metadata["api_request_error"]``."""
        err_msg = ""
        result = ""
        metadata: dict[str, Any] = {}
        try:
            call_tool_result = await ClientManager.call_tool(self.name, parameters, self.timeout)
            logger.debug("MCP tool %s, instance %s: %s", self.name, instance_id, call_tool_result.content)
            result, metadata = self._parse_tool_result(call_tool_result.content)
            if _is_error(call_tool_result):
                metadata["tool_error"] = True
        except ClientError as error:
            err_msg = f"\n Tool call failed: {error}"
        except ConnectionError as error:
            err_msg = f"\n Connection failed: {error}"
        except TimeoutError:
            err_msg = f"\n Tool call failed: no answer within {self.timeout:g}s"
        except Exception as error:
            err_msg = f"\n An unexpected error occurred: {_describe(error)}"
        if err_msg:
            result = err_msg
            metadata["api_request_error"] = err_msg
        else:
            metadata["api_request_error"] = None
        return result, metadata

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[str, float, dict]:
        """Call the server's tool with ``parameters``; ``(text, 0.0, metrics)``, never raises."""
        if not self.name or not isinstance(parameters, dict):
            error_msg = "Error: 'parameters' is missing or empty."
            logger.error("[MCPTool] %s tool name: %s, parameters: %r", error_msg, self.name, parameters)
            return json.dumps({"result": error_msg}), 0.0, {"error": "bad arguments"}
        try:
            result_text, metadata = await self._call_tool(instance_id, parameters)
            self._instance_dict.setdefault(instance_id, {"response": "", "reward": []})
            self._instance_dict[instance_id]["reward"].append(result_text.strip())
            metrics: dict[str, Any] = {
                "query_count": metadata.get("query_count", 0),
                "status": metadata.get("status", "unknown"),
                "total_results": metadata.get("total_results", 0),
                "api_request_error": metadata.get("api_request_error"),
            }
            if metadata.get("api_request_error"):
                metrics["error"] = "mcp request failed"
                logger.warning("MCP tool %s failed: %s", self.name, str(metadata["api_request_error"])[:300])
            elif metadata.get("tool_error"):
                metrics["error"] = "mcp tool error"
            return result_text, 0.0, metrics
        except Exception as error:  # a parser of a subclass that raises
            logger.error("[MCPBaseTool] execution failed: %s", error)
            return json.dumps({"result": f"Tool execution failed: {error}"}), 0.0, {"error": str(error)}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    def responses(self, instance_id: str) -> list[str]:
        """The texts this instance's calls received (verl's ``calc_reward`` returns them)."""
        return list(self._instance_dict.get(instance_id, {}).get("reward", []))

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)

    def _parse_tool_result(self, content: list) -> tuple[str, dict]:
        """The text parts of a result, joined by spaces (verl's); no metadata."""
        texts = [part.text for part in content if getattr(part, "type", None) == "text"]
        return " ".join(texts), {}


def _is_error(call_tool_result: Any) -> bool:
    flag = getattr(call_tool_result, "is_error", None)
    return bool(getattr(call_tool_result, "isError", False) if flag is None else flag)


def _describe(error: BaseException) -> str:
    """``error``'s message, or its first sub-exception's (anyio raises exception groups)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
