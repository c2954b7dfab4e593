"""The ``lookup`` tool (the long-tail benchmark's stand-in for a retrieval API): each sample gets its own
value after its own latency, and a waiting call does not hold up the others."""

import asyncio
import time

from hybridflow.workers.rollout.tools.base_tool import ToolSchema
from hybridflow.workers.rollout.tools.lookup_tool import LookupTool

SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "today's fruit",
        "parameters": {"type": "object", "properties": {}},
    },
}


def test_each_sample_gets_its_value_after_its_latency_and_calls_overlap():
    tool = LookupTool({}, ToolSchema.from_dict(SCHEMA))

    async def one(value, latency):
        instance = await tool.create(value=value, latency_s=latency)
        started = time.perf_counter()
        text, reward, metrics = await tool.execute(instance, {})
        await tool.release(instance)
        return text, metrics, time.perf_counter() - started

    async def both():
        return await asyncio.gather(one("pear", 0.3), one("fig", 0.05))

    started = time.perf_counter()
    (slow_text, _, slow_s), (fast_text, fast_metrics, fast_s) = asyncio.run(both())
    assert (slow_text, fast_text, fast_metrics) == ("value: pear", "value: fig", {})
    assert slow_s >= 0.3 and fast_s < 0.25  # the fast one did not wait for the slow one
    assert time.perf_counter() - started < 0.3 + 0.25  # concurrent, not 0.35 s in sequence plus


def test_unknown_instance_and_missing_value_are_error_responses():
    tool = LookupTool({"default_latency_s": 0}, ToolSchema.from_dict(SCHEMA))

    async def calls():
        unknown = await tool.execute("nope", {})
        empty = await tool.execute(await tool.create(), {})
        return unknown, empty

    (unknown_text, _, unknown_metrics), (empty_text, _, empty_metrics) = asyncio.run(calls())
    assert unknown_text.startswith("Error: unknown instance") and unknown_metrics["error"]
    assert empty_text.startswith("Error: nothing stored") and empty_metrics["error"]
