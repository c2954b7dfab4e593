"""verl's ``SearchTool`` against the real retrieval server: loaded from verl's tool YAML, verl's text and
metrics; a server that is down, slow or answers junk costs that call only (an error string and a failed
call in the metrics, never an exception); verl's module paths through the alias."""

import asyncio
import json
import time
from pathlib import Path

import pytest

from hybridflow.workers.rollout.tools.limits import CallLimits
from hybridflow.workers.rollout.tools.registry import load_tools, resolve_tool_class
from hybridflow.workers.rollout.tools.search_tool import SearchTool

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[2]

# verl's examples/sglang_multiturn/config/tool_config/search_tool_config.yaml, its `item:` typo included
# (its one long line folded)
VERL_TOOL_CONFIG = """
tools:
  - class_name: verl.tools.search_tool.SearchTool
    config:
      retrieval_service_url: {url}
      num_workers: 120
      rate_limit: 120
      timeout: {timeout}
      type: native
{extra}
    tool_schema:
      type: function
      function:
        name: search
        description: Searches the web for relevant information based on the given query.
        parameters:
          type: object
          properties:
            query_list:
              type: array
              item:
                type: string
              description: >-
                A list of fully-formed semantic queries. The tool will return search results for each query.
          required:
            - query_list
"""
EVEREST = "Mount Everest is Earth's highest mountain above sea level"
PYTHON = "Python was created by Guido van Rossum."


def make_tool(tmp_path, url, timeout=5, **extra):
    path = tmp_path / "search_tool_config.yaml"
    lines = "".join(f"      {key}: {value}\n" for key, value in extra.items())
    path.write_text(VERL_TOOL_CONFIG.format(url=url, timeout=timeout, extra=lines.rstrip("\n")))
    tool = load_tools(str(path))["search"]
    assert isinstance(tool, SearchTool)
    return tool


async def call(tool, parameters):
    instance = await tool.create(ground_truth={"target": ["x"]}, question="q", data_source="searchR1_nq")
    try:
        return await tool.execute(instance, parameters)
    finally:
        assert await tool.calc_reward(instance) == 0.0
        await tool.release(instance)


def test_search_tool_returns_verls_text_and_metrics(tmp_path, retrieval_server):
    url, _ = retrieval_server
    tool = make_tool(tmp_path, url, topk=1)
    assert tool.get_openai_tool_schema()["function"]["name"] == "search" and tool.topk == 1
    text, reward, metrics = asyncio.run(call(tool, {"query_list": ["highest mountain", "python creator"]}))
    expected = f"Doc 1 (Title: Mount Everest)\n{EVEREST}\n---\nDoc 1 (Title: Python (programming language))\n"
    expected += PYTHON
    assert text == json.dumps({"result": expected}) and reward == 0.0
    assert {k: v for k, v in metrics.items() if k != "duration_s"} == {
        "query_count": 2,
        "status": "success",
        "total_results": 2,
        "api_request_error": None,
    }
    # topk 3 (verl's default): blank-line separated passages of one query, best first
    text, _, metrics = asyncio.run(call(make_tool(tmp_path, url), {"query_list": ["capital of France"]}))
    passages = json.loads(text)["result"].split("\n\n")
    assert passages[0] == "Doc 1 (Title: Paris)\nParis is the capital and largest city of France."
    assert passages[1].startswith("Doc 2 (Title: Berlin)\n") and metrics["total_results"] == len(passages)


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({}, "missing, empty, or not a list"),
        ({"query_list": "paris"}, "not a list"),
        ({"query_list": [1]}, "list of strings"),
    ],
)
def test_bad_arguments_are_the_models_feedback(tmp_path, retrieval_server, parameters, says):
    text, _, metrics = asyncio.run(call(make_tool(tmp_path, retrieval_server[0]), parameters))
    assert says in json.loads(text)["result"] and metrics["error"] == "bad arguments"


def test_a_down_slow_or_junk_server_costs_only_that_call(tmp_path, retrieval_server, junk_server):
    good_url, process = retrieval_server
    junk, hits = junk_server
    down = f"http://127.0.0.1:{free_port()}/retrieve"
    cases = {  # url -> (what the text says, metrics status)
        down: ("Connection Error", "api_error"),
        f"{junk}/slow": ("Timeout Error: no answer within 1s", "api_error"),
        f"{junk}/junk": ("JSON Decode Error", "api_error"),
        f"{junk}/error": ("Server Error (500) on attempt 2/2", "api_error"),
        f"{junk}/list": ("Error processing search results", "processing_error"),
        f"{junk}/baddoc": ("Error processing search results", "processing_error"),
        f"{junk}/empty": ("Unknown API state", "unknown_api_state"),
        "ftp://127.0.0.1/retrieve": ("API Request Error", "api_error"),
    }

    async def all_at_once():
        tools = [make_tool(tmp_path, url, timeout=1, max_retries=2, retry_delay_s=0) for url in cases]
        good = make_tool(tmp_path, good_url, topk=1)
        return await asyncio.gather(*(call(t, {"query_list": ["paris"]}) for t in [*tools, good]))

    started = time.monotonic()
    *failed, ok = asyncio.run(all_at_once())
    assert time.monotonic() - started < 4  # two 1 s timeouts of /slow, the other calls meanwhile
    for (text, _, metrics), (says, status) in zip(failed, cases.values()):
        result = json.loads(text)["result"]
        assert says in result and metrics["status"] == status and metrics["error"] == f"search {status}"
        assert metrics["query_count"] == 1 and metrics["total_results"] == 0
    assert "Search error: API Call Failed" in json.loads(failed[0][0])["result"]
    assert hits["/error"] == 2 and hits["/junk"] == 1  # 5xx retried (max_retries), junk not
    assert json.loads(ok[0])["result"].startswith("Doc 1 (Title: Paris)") and "error" not in ok[2]
    # an answer with no results is not a failure (verl's "no_results"); a 4xx from our server is
    text, _, metrics = asyncio.run(call(make_tool(tmp_path, f"{junk}/no_results"), {"query_list": ["q"]}))
    assert json.loads(text)["result"] == "No search results found." and "error" not in metrics
    text, _, metrics = asyncio.run(call(make_tool(tmp_path, good_url, topk=99), {"query_list": ["q"]}))
    assert "HTTP 422" in json.loads(text)["result"] and metrics["status"] == "api_error"
    assert process.poll() is None


def test_call_limits_bound_the_calls_in_flight():
    async def peak(limits, calls):
        state = {"now": 0, "peak": 0}

        async def one():
            async with limits.hold():
                state["now"] += 1
                state["peak"] = max(state["peak"], state["now"])
                await asyncio.sleep(0.01)
                state["now"] -= 1

        await asyncio.gather(*(one() for _ in range(calls)))
        return state["peak"]

    assert asyncio.run(peak(CallLimits("test_a", num_workers=2, rate_limit=None), 6)) == 2
    assert asyncio.run(peak(CallLimits("test_b", num_workers=5, rate_limit=3), 6)) == 3


def test_verl_module_paths_reach_these_implementations(retrieval_server):
    from hybridflow import verl_compat
    from hybridflow.workers.rollout.tools import search_r1_like_utils as ours

    assert resolve_tool_class("verl.tools.search_tool.SearchTool") is SearchTool
    shipped = load_tools(str(ROOT / "examples" / "tools" / "search_tool_config.yaml"))["search"]
    assert isinstance(shipped, SearchTool) and shipped.retrieval_service_url == "http://127.0.0.1:8000/retrieve"
    assert verl_compat.install()
    try:
        from verl.tools.search_tool import SearchTool as VerlSearchTool
        from verl.tools.utils.search_r1_like_utils import _passages2string, perform_single_search_batch

        assert VerlSearchTool is SearchTool and _passages2string is ours.passages_to_string
        # verl's synchronous helper, as verl's tool calls it from a worker thread
        text, metadata = perform_single_search_batch(retrieval_server[0], ["highest mountain"], topk=1)
        assert text == json.dumps({"result": f"Doc 1 (Title: Mount Everest)\n{EVEREST}"})
        assert metadata["status"] == "success" and metadata["api_response"]["result"][0][0]["score"] > 0
    finally:
        verl_compat.uninstall()
