"""Small MCP servers for the MCP tool tests, on fastmcp, in one process:
``python mcp_server_for_tests.py PORT:TRANSPORT[:TOKEN] ...`` (TRANSPORT ``sse`` or ``http``; with TOKEN,
requests without ``Authorization: Bearer TOKEN`` get 401).

Tools: ``tavily_search_tool`` (answers Tavily's JSON: ``query`` and ``results`` with ``title``, ``url``,
``content``), ``shout`` (its text upper-cased), ``fail`` (raises: an ``isError`` result) and ``nap``
(sleeps, then answers).
"""

import asyncio
import json
import sys

from fastmcp import FastMCP
from fastmcp.exceptions import ToolError


def tavily_search_tool(query: str, max_results: int = 2) -> str:
    """Search the test corpus."""
    results = [
        {"title": f"{query} page {i}", "url": f"https://example.org/{i}", "content": f"About {query}, {i}."}
        for i in range(max_results)
    ]
    return json.dumps({"query": query, "results": results})


def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


def fail(message: str) -> str:
    """Always fails."""
    raise ToolError(f"refused: {message}")


async def nap(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "awake"


def serve(spec: str):
    """The server of one ``PORT:TRANSPORT[:TOKEN]``, as a coroutine."""
    port, transport, *token = spec.split(":")
    auth = None
    if token:
        from fastmcp.server.auth.providers.jwt import StaticTokenVerifier

        auth = StaticTokenVerifier({token[0]: {"client_id": "tests", "scopes": []}})
    server = FastMCP("hybridflow-tests", auth=auth)
    for tool in (tavily_search_tool, shout, fail, nap):
        server.tool(tool)
    return server.run_http_async(
        transport=transport, host="127.0.0.1", port=int(port), show_banner=False, log_level="warning"
    )


async def main(specs: list[str]) -> None:
    await asyncio.gather(*(serve(spec) for spec in specs))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
