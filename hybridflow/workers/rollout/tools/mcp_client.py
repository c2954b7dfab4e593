"""verl's MCP client manager: the MCP servers of an ``mcp_server.json``, over ``fastmcp``'s ``Client``.

verl's ``verl/tools/utils/mcp_clients/McpClientManager.py`` and its ``utils.py`` (``TokenBucket``,
``mcp2openai``), both importable under verl's paths through the ``verl`` alias. The config file is the
``mcpServers`` format::

    {"mcpServers": {
        "Tavily Expert": {"url": "https://.../sse", "auth_token": "..."},
        "local": {"url": "http://127.0.0.1:8000/mcp"}
    }}

A server with ``auth_token`` gets its own client over fastmcp's ``SSETransport`` with the header
``Authorization: Bearer <auth_token>`` (verl's rule); the others share one ``Client`` built from their
``mcpServers`` entries (fastmcp picks the transport from each entry: streamable HTTP, SSE for a ``/sse``
URL, ``command`` for stdio; with several servers in it, fastmcp prefixes each tool's name with its
server's). :meth:`MCPClientManager.fetch_tool_schemas` lists the servers' tools as OpenAI function
schemas and remembers which client serves each name; :meth:`MCPClientManager.call_tool` calls one,
connecting for the call (``async with client``, verl's pattern), after the ``rate_limit`` token bucket.

Differences from verl, each so that a call cannot hang or be misrouted:

- a ``fastmcp.Client`` belongs to the event loop it connects in, and the tools are loaded in a loop of
  their own (verl's too) before the rollout's loop uses them, so a client is built per event loop from
  the same settings (:attr:`MCPClientManager.clients` holds those settings);
- ``call_tool``'s ``timeout`` (the tool config's ``timeout``, verl's default 30 s) bounds the connection
  and the call (verl passes it and never uses it);
- a second ``mcp_servers_config_path`` (or the same file, changed) adds its servers (verl keeps the first
  file's and ignores the rest), and ``fetch_tool_schemas(..., config_path=...)`` lists only that file's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import weakref
from typing import Any

try:
    from fastmcp import Client
    from fastmcp.client.transports import SSETransport
    from fastmcp.exceptions import ClientError  # noqa: F401  (re-exported: mcp_base_tool's)
except ImportError as error:  # an optional dependency: say which extra brings it
    raise ImportError(
        f"verl's MCP tools need the fastmcp package ({error}); install hybridflow's serve extra: "
        "pip install -e '.[serve]'"
    ) from error

logger = logging.getLogger(__name__)

ROOT_SERVER_NAME = "mcpServers"
FETCH_RETRIES = 10  # verl's: an empty tool listing is retried (a server still starting)
FETCH_RETRY_S = 2.0


class TokenBucket:
    """verl's rate limiter: ``rate_limit`` tokens a second, at most ``rate_limit`` saved up."""

    def __init__(self, rate_limit: float) -> None:
        self.rate_limit = rate_limit
        self.tokens = rate_limit
        self.last_update = time.time()
        self.lock = threading.Lock()

    def acquire(self) -> bool:
        """Take a token if one is there (True), else False; never waits."""
        with self.lock:
            now = time.time()
            self.tokens = min(self.rate_limit, self.tokens + (now - self.last_update) * self.rate_limit)
            self.last_update = now
            if self.tokens >= 1:
                self.tokens -= 1
                return True
            return False


def mcp2openai(mcp_tool: Any) -> dict:
    """An MCP ``Tool`` as an OpenAI function-tool schema (verl's; ``required`` always present)."""
    parameters = getattr(mcp_tool, "input_schema", None)
    if parameters is None:  # the MCP SDK before v2 named it inputSchema
        parameters = getattr(mcp_tool, "inputSchema", None)
    parameters = dict(parameters or {"type": "object", "properties": {}})
    if not parameters.get("required", None):
        parameters["required"] = []
    return {
        "type": "function",
        "function": {
            "name": mcp_tool.name,
            "description": mcp_tool.description,
            "parameters": parameters,
            "strict": False,
        },
    }


class MCPClientManager:
    """verl's ``MCPClientManager`` (module docstring); ``ClientManager`` is the process's one."""

    rootServerName = ROOT_SERVER_NAME  # noqa: N815 (verl's attribute name)

    def __init__(self) -> None:
        self.initialized = False
        # One entry per client: ("sse", url, token) for a server with auth_token, ("config", {...}) for
        # the servers without one. The Client objects themselves are per event loop (_loop_clients).
        self.clients: list[tuple] = []
        self.tool_client_mapping: dict[str, int] = {}  # tool name -> index into clients
        self.rate_limiter: TokenBucket | None = None
        self._config_clients: dict[str, list[int]] = {}  # servers (as JSON) -> their clients
        self._path_keys: dict[str, str] = {}  # config file (absolute) -> its servers, as last read
        self._loop_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    async def initialize(self, config_path: str, rate_limit: float = 10.0) -> None:
        """Read ``config_path`` (``mcpServers``) and set up its clients (servers already read keep theirs).

        Raises ``ValueError`` when the file is missing, is not JSON or has no ``mcpServers`` mapping.
        """
        with self._lock:
            servers = self._load_config(config_path).get(self.rootServerName)
            if not isinstance(servers, dict) or not servers:
                raise ValueError(f"{config_path}: expected a non-empty {self.rootServerName!r} mapping")
            key = json.dumps(servers, sort_keys=True, default=str)
            self._path_keys[os.path.abspath(config_path)] = key
            if key in self._config_clients:
                return
            indices: list[int] = []
            without_token: dict[str, Any] = {}
            for server_name, server in servers.items():
                if not isinstance(server, dict):
                    raise ValueError(f"{config_path}: server {server_name!r} must be a mapping")
                if "auth_token" in server:
                    if not server.get("url"):
                        raise ValueError(f"{config_path}: server {server_name!r} has auth_token but no url")
                    indices.append(len(self.clients))
                    self.clients.append(("sse", str(server["url"]), str(server["auth_token"])))
                else:
                    without_token[server_name] = server
            if without_token:
                indices.append(len(self.clients))
                self.clients.append(("config", {self.rootServerName: without_token}))
            self._config_clients[key] = indices
            if self.rate_limiter is None:
                self.rate_limiter = TokenBucket(float(rate_limit))
            self.initialized = True

    async def call_tool(self, tool_name: str, parameters: dict[str, Any], timeout: float | None):
        """The server's ``CallToolResult`` of ``tool_name(**parameters)``, within ``timeout`` seconds."""
        while not self.rate_limiter.acquire():
            await asyncio.sleep(0.1)
        client = self.get_client_with_tool_name(tool_name)

        async def connect_and_call():
            async with client:
                return await client.call_tool_mcp(tool_name, parameters, timeout=timeout)

        return await asyncio.wait_for(connect_and_call(), timeout)

    async def fetch_tool_schemas(
        self, tool_selected_list: list[str] | None, config_path: str | None = None
    ) -> list[dict]:
        """The OpenAI schemas of the servers' tools (those in ``tool_selected_list`` when it is not
        empty), of every server read so far or only of ``config_path``'s."""
        if config_path is None:
            indices = list(range(len(self.clients)))
        else:
            indices = self._config_clients[self._path_keys[os.path.abspath(config_path)]]
        tool_schemas = []
        for index in indices:
            client = self._client(index)
            async with client:
                tools = await client.list_tools_mcp()
            for tool in tools.tools:
                if not tool_selected_list or tool.name in tool_selected_list:
                    self.tool_client_mapping[tool.name] = index
                    tool_schemas.append(mcp2openai(tool))
        return tool_schemas

    def get_client_with_tool_name(self, tool_name: str):
        """The ``fastmcp.Client`` (of the running event loop) that serves ``tool_name``."""
        if tool_name not in self.tool_client_mapping:
            raise KeyError(f"no MCP server read so far has a tool named {tool_name!r}")
        return self._client(self.tool_client_mapping[tool_name])

    def _client(self, index: int):
        loop = asyncio.get_running_loop()
        built = self._loop_clients.setdefault(loop, {})
        if index not in built:
            spec = self.clients[index]
            if spec[0] == "sse":
                _, url, token = spec
                built[index] = Client(SSETransport(url=url, headers={"Authorization": f"Bearer {token}"}))
            else:
                built[index] = Client(spec[1])
        return built[index]

    def _load_config(self, file: str) -> dict[str, Any]:
        try:
            with open(file) as handle:
                data = json.load(handle)
        except FileNotFoundError:
            raise ValueError(f"MCP servers config {file!r} was not found") from None
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read MCP servers config {file!r}: {error}") from error
        if not isinstance(data, dict):
            raise ValueError(f"{file}: expected a JSON object with {self.rootServerName!r}")
        return data


ClientManager = MCPClientManager()


async def initialize_mcp_tool(tool_cls, tool_config: dict[str, Any], config_path: str | None = None) -> list:
    """verl's ``tool_registry.initialize_mcp_tool``: one ``tool_cls`` per tool the entry's servers list.

    ``tool_config`` is the tool YAML's entry as plain containers (``config``, ``mcp``:
    ``mcp_servers_config_path``, optional ``tool_selected_list``); ``config_path`` the servers file as
    resolved by the caller (default: the entry's, as written). Retries an empty listing as verl does
    (:data:`FETCH_RETRIES` times, :data:`FETCH_RETRY_S` apart); a server that cannot be reached, or does
    not answer the listing within the entry's ``timeout`` (30 s), raises.
    """
    from hybridflow.workers.rollout.tools.base_tool import ToolSchema

    mcp = tool_config.get("mcp") or {}
    config = dict(tool_config.get("config") or {})
    path = config_path or mcp["mcp_servers_config_path"]
    selected = mcp.get("tool_selected_list") or None
    await ClientManager.initialize(path, float(config.get("rate_limit", 10.0)))
    for attempt in range(FETCH_RETRIES):
        tool_schemas = await asyncio.wait_for(  # a server that accepts and never answers: the tool's timeout
            ClientManager.fetch_tool_schemas(selected, config_path=path), float(config.get("timeout", 30))
        )
        if tool_schemas:
            break
        if attempt < FETCH_RETRIES - 1:
            logger.debug("waiting for the MCP servers of %s, attempt %d/%d", path, attempt + 1, FETCH_RETRIES)
            await asyncio.sleep(FETCH_RETRY_S)
    else:
        wanted = f" named {sorted(selected)}" if selected else ""
        raise RuntimeError(f"the MCP servers of {path} list no tools{wanted}")
    return [tool_cls(dict(config), ToolSchema.from_dict(schema)) for schema in tool_schemas]


def load_mcp_tools(tool_cls, tool_config: dict[str, Any], config_path: str | None = None) -> list:
    """:func:`initialize_mcp_tool` from synchronous code, in an event loop of its own on a thread (verl's
    way: the caller may itself be inside a running loop)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["tools"] = asyncio.run(initialize_mcp_tool(tool_cls, tool_config, config_path))
        except BaseException as error:  # handed to the caller's thread
            result["error"] = error

    thread = threading.Thread(target=run, name="mcp tool list fetcher", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["tools"]
