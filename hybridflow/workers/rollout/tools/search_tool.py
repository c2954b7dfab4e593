"""verl's ``SearchTool``: the model's ``search`` calls go to a Search-R1 retrieval server.

Registered under verl's class path ``verl.tools.search_tool.SearchTool``. A call's ``query_list`` is one
``POST`` to ``retrieval_service_url`` (the full ``.../retrieve`` address of
``python -m hybridflow.retrieval serve``, of verl's Search-R1 dense retriever, or of any server with
Search-R1's API), with httpx; the client and the text it returns (verl's:
``{"result": "Doc 1 (Title: ...)..."}``) are :mod:`~hybridflow.workers.rollout.tools.search_r1_like_utils`.

Config keys (verl's): ``retrieval_service_url`` (required), ``topk`` (3: passages per query), ``timeout``
(30 s: one attempt), ``num_workers`` (120: calls of this tool in flight at once), ``rate_limit`` (120)
with ``enable_global_rate_limit`` (true: calls in flight over every SearchTool of this process; verl's
limiter spans the Ray cluster). Ours: ``max_retries`` (verl's 10 attempts) and ``retry_delay_s`` (1),
for servers that are known to be down rather than busy.

A server that is down, too slow, or answers an HTTP error or junk fails this call alone: ``execute`` never
raises; the text says what happened (verl's ``{"result": "Search error: ..."}``) and ``metrics["error"]``
marks the call as failed in the rollout's tool counts. The metrics are verl's (``query_count``,
``status``, ``total_results``, ``api_request_error``) plus ``duration_s``. The tool gives no reward
(``calc_reward`` is 0.0; verl returns the texts found, which no reward sums).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from hybridflow.workers.rollout.tools import limits
from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema
from hybridflow.workers.rollout.tools.search_r1_like_utils import (
    DEFAULT_TIMEOUT,
    INITIAL_RETRY_DELAY,
    MAX_RETRIES,
    search_batch,
)

logger = logging.getLogger(__name__)

SEARCH_TOOL_SCHEMA: dict[str, Any] = {  # verl's example schema (examples/.../search_tool_config.yaml)
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the web for relevant information based on the given query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "A list of fully-formed semantic queries. The tool will return search "
                    "results for each query.",
                }
            },
            "required": ["query_list"],
        },
    },
}
OK_STATUSES = ("success", "no_results")  # any other status of a search is a failed call
BAD_QUERY_LIST = "Error: 'query_list' is missing, empty, or not a list in parameters."  # verl's words


class SearchTool(BaseTool):
    """``search`` over a retrieval server (module docstring)."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | None = None) -> None:
        super().__init__(config or {}, tool_schema or ToolSchema.from_dict(SEARCH_TOOL_SCHEMA))
        self.retrieval_service_url = str(self.config.get("retrieval_service_url") or "")
        if not self.retrieval_service_url:
            raise ValueError("retrieval_service_url is not set (the server's .../retrieve address)")
        self.topk = limits.positive_int(self.config, "topk", 3)
        self.timeout = float(self.config.get("timeout", DEFAULT_TIMEOUT))
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout}")
        self.max_retries = limits.positive_int(self.config, "max_retries", MAX_RETRIES)
        self.retry_delay_s = max(0.0, float(self.config.get("retry_delay_s", INITIAL_RETRY_DELAY)))
        self.limits = limits.from_config("search", self.config, num_workers=120, rate_limit=120)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[str, float, dict]:
        """Search ``parameters["query_list"]``; ``(text, 0.0, metrics)``, never raises."""
        query_list = parameters.get("query_list") if isinstance(parameters, dict) else None
        if not query_list or not isinstance(query_list, list):
            return json.dumps({"result": BAD_QUERY_LIST}), 0.0, {"error": "bad arguments"}
        if not all(isinstance(query, str) for query in query_list):
            message = "Error: 'query_list' must be a list of strings."
            return json.dumps({"result": message}), 0.0, {"error": "bad arguments"}
        started = time.monotonic()
        async with self.limits.hold():
            text, metadata = await search_batch(
                self.retrieval_service_url,
                query_list,
                self.topk,
                self.timeout,
                max_retries=self.max_retries,
                retry_delay=self.retry_delay_s,
            )
        metrics: dict[str, Any] = {
            "query_count": metadata["query_count"],
            "status": metadata["status"],
            "total_results": metadata["total_results"],
            "api_request_error": metadata["api_request_error"],
            "duration_s": time.monotonic() - started,
        }
        if metadata["status"] not in OK_STATUSES:
            metrics["error"] = f"search {metadata['status']}"
            logger.warning("search at %s failed: %s", self.retrieval_service_url, text[:300])
        return text, 0.0, metrics
