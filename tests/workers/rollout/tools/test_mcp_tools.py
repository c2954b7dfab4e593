"""verl's MCP tools against real MCP server processes (fastmcp's, started here), through the real fastmcp
client: verl's tool YAML and ``mcp_server.json`` load unchanged (SSE with a bearer token, streamable
HTTP without one); a tool that fails, is too slow, or a server that is down or answers junk costs that
call only (an error string, a failed call in the rollout's counts, never an exception); verl's module
paths through the alias; a bad MCP entry is refused before anything runs."""

import asyncio
import contextlib
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from hybridflow.utils.ports import find_free_port as free_port
from hybridflow.workers.rollout.multi_turn import _ToolSession
from hybridflow.workers.rollout.tools import mcp_client
from hybridflow.workers.rollout.tools.mcp_base_tool import MCPBaseTool
from hybridflow.workers.rollout.tools.mcp_client import MCPClientManager, TokenBucket, mcp2openai
from hybridflow.workers.rollout.tools.mcp_search_tool import MCPSearchTool
from hybridflow.workers.rollout.tools.parser import ToolCall
from hybridflow.workers.rollout.tools.registry import ToolConfigError, check_tool_config, load_tools

SERVER = Path(__file__).with_name("mcp_server_for_tests.py")
TOKEN = "issue-49-token"

# verl's examples/sglang_multiturn/config/tool_config/mcp_tool_config.yaml (less a trailing space)
VERL_TOOL_CONFIG = """tools:
  - class_name: verl.tools.mcp_search_tool.MCPSearchTool
    config:
      rate_limit: 120
      timeout: 120
      type: mcp
    mcp:
      mcp_servers_config_path: ./mcp_server.json
      # optional
      tool_selected_list:
        - tavily_search_tool
"""
BASE_TOOL_CONFIG = """tools:
  - class_name: verl.tools.mcp_base_tool.MCPBaseTool
    config: {{rate_limit: 120, timeout: {timeout}, type: mcp}}
    mcp:
      mcp_servers_config_path: {servers}
"""


def start_servers(*specs: tuple[str, str]):
    """``(process, [(url, port), ...])``: one ``mcp_server_for_tests.py`` process serving each
    ``(transport, token)`` on a free port; waits until every port accepts connections."""
    ports = [free_port() for _ in specs]
    command = [sys.executable, str(SERVER)]
    command += [
        ":".join([str(port), transport] + ([token] if token else []))
        for port, (transport, token) in zip(ports, specs)
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tempfile.TemporaryFile()  # not a pipe: a chatty server never blocks on it
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    process.log = log
    try:
        for port in ports:
            wait_ready(process, port)
    except BaseException:
        stop(process)
        raise
    paths = ["/sse" if transport == "sse" else "/mcp" for transport, _ in specs]
    return process, [(f"http://127.0.0.1:{port}{path}", port) for port, path in zip(ports, paths)]


def wait_ready(process, port: int, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        if process.poll() is not None:
            process.log.seek(0)
            raise RuntimeError(f"the MCP test server exited: {process.log.read().decode()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the MCP test server did not start")
        time.sleep(0.1)


def stop(process) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.log.close()


@pytest.fixture(scope="module")
def servers():
    """``{"sse": url, "http": url}``: SSE with bearer ``TOKEN``, streamable HTTP without a token (one
    process)."""
    process, urls = start_servers(("sse", TOKEN), ("http", ""))
    try:
        yield {"sse": urls[0][0], "http": urls[1][0]}
    finally:
        stop(process)


def write_servers(folder: Path, servers: dict) -> Path:
    path = folder / "mcp_server.json"
    path.write_text(json.dumps({"mcpServers": servers}, indent=4))
    return path


def base_tools(tmp_path: Path, url: str, timeout: float = 10) -> dict:
    servers = write_servers(tmp_path, {"local": {"url": url}})
    config = tmp_path / "mcp_tools.yaml"
    config.write_text(BASE_TOOL_CONFIG.format(timeout=timeout, servers=servers))
    return load_tools(str(config))


async def call(tool, parameters: dict):
    instance = await tool.create()
    try:
        return await tool.execute(instance, parameters)
    finally:
        await tool.release(instance)


def test_verl_config_loads_unchanged_and_searches_over_sse_with_a_bearer_token(tmp_path, servers):
    # verl's mcp_server.json layout: a server with auth_token gets an SSE client with the bearer header
    write_servers(tmp_path, {"Tavily Expert": {"url": servers["sse"], "auth_token": TOKEN}})
    (tmp_path / "mcp_tool_config.yaml").write_text(VERL_TOOL_CONFIG)
    tools = load_tools(str(tmp_path / "mcp_tool_config.yaml"))  # ./mcp_server.json: beside the YAML
    assert list(tools) == ["tavily_search_tool"]  # tool_selected_list left the others out
    tool = tools["tavily_search_tool"]
    assert isinstance(tool, MCPSearchTool) and tool.timeout == 120
    schema = tool.get_openai_tool_schema()["function"]
    assert (
        schema["parameters"]["required"] == ["query"] and "max_results" in schema["parameters"]["properties"]
    )

    async def run():
        instance = await tool.create()
        result = await tool.execute(instance, {"query": "Paris", "max_results": 3})
        return result, tool.responses(instance), await tool.calc_reward(instance)

    (text, reward, metrics), responses, total = asyncio.run(run())
    # verl's parse: the "results" list of the text, its titles counted
    assert json.loads(text) == [
        {"title": f"Paris page {i}", "url": f"https://example.org/{i}", "content": f"About Paris, {i}."}
        for i in range(3)
    ]
    assert metrics == {"query_count": 1, "status": "success", "total_results": 3, "api_request_error": None}
    assert reward == 0.0 and total == 0.0 and responses == [text]


def test_servers_without_a_token_over_streamable_http(tmp_path, servers):
    tools = base_tools(tmp_path, servers["http"])
    assert set(tools) == {"tavily_search_tool", "shout", "fail", "nap"}  # no tool_selected_list: all
    assert all(type(tool) is MCPBaseTool for tool in tools.values())
    text, reward, metrics = asyncio.run(call(tools["shout"], {"text": "over http"}))
    assert (text, reward, metrics["api_request_error"], "error" in metrics) == ("OVER HTTP", 0.0, None, False)

    async def many():  # samples calling at once share the loop's client (verl's `async with client` each)
        return await asyncio.gather(*(call(tools["shout"], {"text": f"sample {i}"}) for i in range(8)))

    assert [text for text, _, _ in asyncio.run(many())] == [f"SAMPLE {i}" for i in range(8)]


def test_a_wrong_or_missing_token_is_refused_when_the_tools_load(tmp_path, servers):
    config = tmp_path / "mcp_tool_config.yaml"
    config.write_text(VERL_TOOL_CONFIG)
    for server in ({"url": servers["sse"], "auth_token": "wrong"}, {"url": servers["sse"]}):
        write_servers(tmp_path, {"Tavily Expert": server})
        with pytest.raises(ToolConfigError, match=r"tools\[0\]: MCP tools of .*401 Unauthorized"):
            load_tools(str(config))
    # the same file, now with the right token, is read again
    write_servers(tmp_path, {"Tavily Expert": {"url": servers["sse"], "auth_token": TOKEN}})
    assert list(load_tools(str(config))) == ["tavily_search_tool"]


def test_a_failing_or_slow_tool_costs_only_its_call(tmp_path, servers):
    tools = base_tools(tmp_path, servers["http"], timeout=1)

    async def run():
        session = _ToolSession(tools, {}, timeout_s=30)
        failed = await session.call(ToolCall("fail", {"message": "no"}))
        started = time.monotonic()
        slow = await session.call(ToolCall("nap", {"seconds": 5}))
        waited = time.monotonic() - started
        fine = await session.call(ToolCall("shout", {"text": "still here"}))
        await session.release()
        return failed, slow, waited, fine

    failed, slow, waited, fine = asyncio.run(run())
    assert "refused: no" in failed[0] and failed[1] is False  # the server's isError result: a failed call
    assert slow == ("\n Tool call failed: no answer within 1s", False) and waited < 4
    assert fine == ("STILL HERE", True)


class _Junk(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        body = b"<html>not an MCP server</html>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer  # noqa: N815 (http.server's names)

    def log_message(self, *args):
        pass


def test_a_server_that_is_down_or_answers_junk_costs_only_its_call(tmp_path):
    process, [(url, port)] = start_servers(("http", ""))
    try:
        tools = base_tools(tmp_path, url, timeout=5)
    finally:
        stop(process)

    async def run():
        session = _ToolSession(tools, {}, timeout_s=30)
        outcome = await session.call(ToolCall("shout", {"text": "anyone?"}))
        await session.release()
        return outcome

    started = time.monotonic()
    (text, ok), (direct, _, metrics) = asyncio.run(run()), asyncio.run(call(tools["shout"], {"text": "x"}))
    assert not ok and "Client failed to connect" in text and time.monotonic() - started < 10
    assert metrics["error"] == "mcp request failed" and metrics["api_request_error"] == direct

    junk = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Junk)  # the same address, now junk
    junk.daemon_threads = True
    threading.Thread(target=junk.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        text, ok = asyncio.run(run())
        assert not ok and "Unexpected content type: text/html" in text and time.monotonic() - started < 10
    finally:
        junk.shutdown()
        junk.server_close()


def test_a_server_that_never_answers_the_listing_is_an_error_within_the_timeout(tmp_path):
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        started = time.monotonic()
        with pytest.raises(ToolConfigError, match="no answer within the entry's timeout"):
            base_tools(tmp_path, f"http://127.0.0.1:{silent.getsockname()[1]}/mcp", timeout=1)
        assert time.monotonic() - started < 5
    finally:
        silent.close()


def test_verl_client_manager_api_and_module_paths(tmp_path, servers):
    from hybridflow import verl_compat

    path = write_servers(tmp_path, {"local": {"url": servers["http"]}})
    manager = MCPClientManager()

    async def run():
        await manager.initialize(str(path), rate_limit=10.0)
        schemas = await manager.fetch_tool_schemas(["shout"])
        result = await manager.call_tool("shout", {"text": "verl"}, 10)
        return schemas, result

    schemas, result = asyncio.run(run())
    assert schemas == [
        {
            "type": "function",
            "function": {
                "name": "shout",
                "description": "Upper-case a text.",
                "parameters": schemas[0]["function"]["parameters"],
                "strict": False,
            },
        }
    ]
    assert schemas[0]["function"]["parameters"]["required"] == ["text"]
    assert [part.text for part in result.content] == ["VERL"]
    bucket = TokenBucket(2)
    assert [bucket.acquire() for _ in range(3)] == [True, True, False]
    assert verl_compat.install()
    try:
        from verl.tools.mcp_base_tool import MCPBaseTool as VerlBase
        from verl.tools.mcp_search_tool import MCPSearchTool as VerlSearch
        from verl.tools.utils.mcp_clients.McpClientManager import ClientManager
        from verl.tools.utils.mcp_clients.utils import mcp2openai as verl_mcp2openai

        assert (VerlBase, VerlSearch, verl_mcp2openai) == (MCPBaseTool, MCPSearchTool, mcp2openai)
        assert ClientManager is mcp_client.ClientManager
    finally:
        verl_compat.uninstall()


@pytest.mark.parametrize(
    "entry, message",
    [
        ("  - class_name: verl.tools.image_zoom_in_tool.ImageZoomInTool\n", "no counterpart"),
        (
            "  - class_name: verl.tools.mcp_search_tool.MCPSearchTool\n    config: {type: mcp}\n",
            "needs an 'mcp:' section",
        ),
        (
            "  - class_name: verl.tools.mcp_search_tool.MCPSearchTool\n    config: {type: mcp}\n"
            "    mcp: {mcp_servers_config_path: ./nowhere.json}\n",
            "'./nowhere.json' is not a file",
        ),
        ("  - class_name: verl.tools.mcp_base_tool.MCPBaseTool\n    config: {type: remote}\n", "config.type"),
    ],
    ids=["unknown verl tool", "no mcp section", "no servers file", "unknown type"],
)
def test_bad_entries_are_refused_without_calling_a_server(tmp_path, entry, message):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n" + entry)
    with pytest.raises(ToolConfigError, match=rf"tools\[0\]: .*{message}"):
        check_tool_config(str(path))
    with pytest.raises(ToolConfigError, match=message):
        load_tools(str(path))


def test_the_shipped_example_is_verls_and_passes_the_check():
    root = Path(__file__).resolve().parents[4]
    check_tool_config(str(root / "examples" / "tools" / "mcp_tool_config.yaml"))  # calls no server
    servers = json.loads((root / "examples" / "tools" / "mcp_server.json").read_text())
    assert servers == {
        "mcpServers": {
            "Tavily Expert": {"url": "your_tavily_expert_url", "auth_token": "your_tavily_api_token"}
        }
    }
