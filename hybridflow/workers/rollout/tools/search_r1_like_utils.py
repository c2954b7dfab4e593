"""The client of a Search-R1 retrieval server, as verl's ``verl/tools/utils/search_r1_like_utils.py``.

One search is one ``POST`` to the server's ``/retrieve`` address (Search-R1's API: ``hybridflow.retrieval``,
or the dense retriever of verl's Search-R1 example)::

    request:  {"queries": ["q1", "q2"], "topk": 3, "return_scores": true}
    response: {"result": [[{"document": {"contents": "Title\\ntext", ...}, "score": 7.1}, ...], ...]}

Retries as verl's client: a connection error, a timeout or an HTTP 500/502/503/504 is tried again, up to
``MAX_RETRIES`` attempts in all, waiting ``INITIAL_RETRY_DELAY * attempt`` seconds between them; any other
HTTP error, or an answer that is not JSON, ends at once. ``timeout`` bounds each attempt as a whole
(``httpx``'s own timeout is per read). The tool text is verl's: the passages of each query as
``Doc 1 (Title: <first line of contents>)\\n<the other lines>``, blank-line separated, queries separated
by ``\\n---\\n``, all inside ``{"result": ...}`` as JSON; a failure is ``{"result": "Search error: ..."}``
(or another message, :func:`search_result`) with the reason in the metadata's ``status``.

Async (:func:`async_call_search_api`, :func:`search_batch`: the ``SearchTool``'s path) and verl's
synchronous functions (:func:`call_search_api`, :func:`perform_single_search_batch`, for code that
calls them from worker threads, as verl does) share one implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30  # seconds one attempt may take (verl's)
MAX_RETRIES = 10  # attempts in all (verl's)
INITIAL_RETRY_DELAY = 1  # seconds before the 2nd attempt; attempt n waits n times this (verl's)
RETRY_STATUS = frozenset({500, 502, 503, 504})
_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


async def async_call_search_api(
    retrieval_service_url: str,
    query_list: list[str],
    topk: int = 3,
    return_scores: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    *,
    max_retries: int = MAX_RETRIES,
    retry_delay: float = INITIAL_RETRY_DELAY,
) -> tuple[Any, str | None]:
    """``(response_json, None)``, or ``(None, "API Call Failed: <why>")`` after the retries (module
    docstring). Never raises (but for cancellation)."""
    import httpx

    payload = {"queries": list(query_list), "topk": topk, "return_scores": return_scores}
    last_error = "no attempt was made"
    async with httpx.AsyncClient(timeout=timeout, headers=_HEADERS) as client:
        for attempt in range(1, max_retries + 1):
            try:
                response = await asyncio.wait_for(client.post(retrieval_service_url, json=payload), timeout)
            except (TimeoutError, httpx.TimeoutException):
                last_error = f"Timeout Error: no answer within {timeout:g}s"
            except httpx.UnsupportedProtocol as error:  # a URL without http(s)://: retrying cannot help
                return None, f"API Call Failed: API Request Error: {error}"
            except httpx.TransportError as error:
                last_error = f"Connection Error: {type(error).__name__}: {error}"
            except Exception as error:  # e.g. a URL httpx cannot parse
                return None, f"API Call Failed: Unexpected Error: {type(error).__name__}: {error}"
            else:
                if response.status_code not in RETRY_STATUS:
                    return _decode(response)
                last_error = (
                    f"API Request Error: Server Error ({response.status_code}) on attempt "
                    f"{attempt}/{max_retries}"
                )
            logger.warning(
                "search at %s, attempt %d/%d: %s", retrieval_service_url, attempt, max_retries, last_error
            )
            if attempt < max_retries:
                await asyncio.sleep(retry_delay * attempt)
    return None, f"API Call Failed: {last_error}"


def _decode(response) -> tuple[Any, str | None]:
    """The JSON of an answer that is not retried, or why there is none."""
    if response.status_code >= 400:
        return None, f"API Call Failed: API Request Error: HTTP {response.status_code}: {response.text[:200]}"
    try:
        return response.json(), None
    except ValueError as error:
        return None, (
            f"API Call Failed: API Response JSON Decode Error: {error}, Response: {response.text[:200]}"
        )


def call_search_api(
    retrieval_service_url: str,
    query_list: list[str],
    topk: int = 3,
    return_scores: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[Any, str | None]:
    """verl's synchronous form of :func:`async_call_search_api` (not from inside a running event loop)."""
    return asyncio.run(async_call_search_api(retrieval_service_url, query_list, topk, return_scores, timeout))


def passages_to_string(retrieval_result: list[dict]) -> str:
    """One query's passages as verl formats them: ``Doc i (Title: t)\\ntext``, blank-line separated."""
    lines = []
    for index, doc_item in enumerate(retrieval_result):
        content = doc_item["document"]["contents"]
        title, _, text = content.partition("\n")
        lines.append(f"Doc {index + 1} (Title: {title})\n{text}\n\n")
    return "".join(lines).strip()


_passages2string = passages_to_string  # verl's name


def search_result(query_list: list[str], api_response: Any, error_msg: str | None) -> tuple[str, dict]:
    """verl's tool text and metadata for one batch search's outcome. ``metadata["status"]``: ``success``,
    ``no_results``, ``api_error`` (the server could not be asked or did not answer well),
    ``processing_error`` (an answer not in Search-R1's shape), ``unknown_api_state`` (an empty answer)."""
    metadata: dict[str, Any] = {
        "query_count": len(query_list),
        "queries": query_list,
        "api_request_error": error_msg,
        "api_response": None,
        "status": "unknown",
        "total_results": 0,
        "formatted_result": None,
    }
    if error_msg:
        metadata["status"] = "api_error"
        return _result(f"Search error: {error_msg}"), metadata
    if not api_response:
        metadata["status"] = "unknown_api_state"
        return _result("Unknown API state (no response and no error message)."), metadata
    metadata["api_response"] = api_response
    try:
        raw_results = api_response.get("result", [])
        if not raw_results:
            metadata["status"] = "no_results"
            return _result("No search results found."), metadata
        formatted = "\n---\n".join(passages_to_string(retrieval) for retrieval in raw_results)
        total = sum(len(retrieval) if isinstance(retrieval, list) else 1 for retrieval in raw_results)
    except Exception as error:  # the answer is not in Search-R1's shape
        metadata["status"] = "processing_error"
        return _result(f"Error processing search results: {error}"), metadata
    metadata.update(status="success", total_results=total, formatted_result=formatted)
    return _result(formatted), metadata


def _result(text: str) -> str:
    return json.dumps({"result": text}, ensure_ascii=False)


async def search_batch(
    retrieval_service_url: str,
    query_list: list[str],
    topk: int = 3,
    timeout: float = DEFAULT_TIMEOUT,
    *,
    max_retries: int = MAX_RETRIES,
    retry_delay: float = INITIAL_RETRY_DELAY,
) -> tuple[str, dict]:
    """One batch search: ``(result_text, metadata)`` (:func:`search_result`); never raises."""
    response, error = await async_call_search_api(
        retrieval_service_url,
        query_list,
        topk,
        True,
        timeout,
        max_retries=max_retries,
        retry_delay=retry_delay,
    )
    return search_result(query_list, response, error)


def perform_single_search_batch(
    retrieval_service_url: str,
    query_list: list[str],
    topk: int = 3,
    concurrent_semaphore: threading.Semaphore | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[str, dict]:
    """verl's synchronous batch search: :func:`search_batch` under ``concurrent_semaphore``."""
    try:
        with concurrent_semaphore or contextlib.nullcontext():
            response, error = call_search_api(retrieval_service_url, query_list, topk, True, timeout)
    except Exception as exc:  # e.g. called inside a running event loop
        response, error = None, f"API Request Exception during batch search: {exc}"
    return search_result(query_list, response, error)
