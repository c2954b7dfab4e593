"""verl's ``MCPSearchTool``: an MCP search tool (Tavily's, in verl's example) whose results it counts.

Registered under verl's class path ``verl.tools.mcp_search_tool.MCPSearchTool``; configured and called as
:class:`~hybridflow.workers.rollout.tools.mcp_base_tool.MCPBaseTool`. verl's parsing of each text part
of the result: single quotes read as double ones; the ``query`` it names; the ``"title":`` keys counted
as results; the text answered is the ``"results": [...]`` lists of the parts, concatenated (a part with
none adds nothing). The metrics add ``status: success``, ``query_count`` (text parts) and
``total_results`` (titles).
"""

from __future__ import annotations

import re

from hybridflow.workers.rollout.tools.mcp_base_tool import MCPBaseTool

QUERY = re.compile(r'query"\s*:\s*"([^"]+)"')
TITLE = re.compile(r'"title"\s*:')
RESULTS = re.compile(r'"results"\s*:\s*(\[.*?\])', re.DOTALL)


class MCPSearchTool(MCPBaseTool):
    """verl's MCP search tool (module docstring)."""

    def _parse_tool_result(self, content: list) -> tuple[str, dict]:
        res = ""
        res_cnt = 0
        query_list = []
        for part in content:
            if getattr(part, "type", None) != "text":
                continue
            text = part.text.replace("'", '"')
            query_match = QUERY.search(text)
            query_list.append(query_match.group(1) if query_match else "")
            results_match = RESULTS.search(text)
            res += results_match.group(1) if results_match else ""
            res_cnt += len(TITLE.findall(text))
        metadata = {
            "api_request_error": "",
            "status": "success",
            "queries": query_list,
            "query_count": len(query_list),
            "total_results": res_cnt,
        }
        return res, metadata
