"""The HTTP app: Search-R1's ``POST /retrieve`` over a :class:`hybridflow.retrieval.corpus.BM25Index`.

Request (Search-R1's ``QueryRequest``)::

    {"queries": ["who wrote hamlet", "capital of france"], "topk": 3, "return_scores": true}

``topk`` is optional (the server's ``--topk``, 3 as Search-R1's); ``return_scores`` defaults to false, as
in Search-R1. Response: one list per query, best first::

    {"result": [[{"document": {"id", "title", "text", "contents"}, "score": 7.1}, ...], ...]}

and without scores each entry is the document itself. ``GET /health`` answers
``{"status": "ok", "documents": n, "topk_max": ..., "max_queries": ...}``.

Bad requests are answered, never crash the server, with ``{"detail": "..."}``: a body over
``max_request_bytes`` (declared or streamed) 413, a body that is not JSON 400, a body that is not an
object, ``queries`` missing or not a list of strings, more than ``max_queries`` queries, ``topk`` not an
integer in ``1..topk_max``, ``return_scores`` not a boolean 422. A failure of the server itself is a 500.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations at build time
import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from hybridflow.retrieval.corpus import BM25Index

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for."""

    default_topk: int = 3  # Search-R1's retrieval_topk
    topk_max: int = 100  # a larger topk is refused (422)
    max_queries: int = 256  # queries in one request
    max_request_bytes: int = 1 << 20  # body size (413 above)

    def __post_init__(self) -> None:
        for name in ("default_topk", "topk_max", "max_queries", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.default_topk > self.topk_max:
            raise ValueError(f"the default topk {self.default_topk} is over topk_max {self.topk_max}")


@dataclass(frozen=True)
class RetrieveRequest:
    """A checked ``POST /retrieve`` body."""

    queries: list[str]
    topk: int
    return_scores: bool


def parse_request(body: bytes, limits: ServerLimits) -> RetrieveRequest:
    """Check a request body; raises ``HTTPException`` (400 or 422) naming what is wrong."""
    try:
        data = json.loads(body)
    except ValueError as error:  # also bytes that are not UTF-8
        raise HTTPException(400, f"the body is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise HTTPException(422, f"the body must be a JSON object, got {type(data).__name__}")
    queries = data.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise HTTPException(422, "'queries' must be a list of strings")
    if len(queries) > limits.max_queries:
        raise HTTPException(422, f"{len(queries)} queries, at most {limits.max_queries} per request")
    topk = data.get("topk")
    topk = limits.default_topk if topk is None else topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.topk_max:
        raise HTTPException(422, f"'topk' must be an integer from 1 to {limits.topk_max}, got {topk!r}")
    return_scores = data.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise HTTPException(422, f"'return_scores' must be true or false, got {return_scores!r}")
    return RetrieveRequest(queries=queries, topk=topk, return_scores=return_scores)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is over ``max_bytes`` (declared or as it streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPException(413, f"the request body is over {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HTTPException(413, f"the request body is over {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(index: BM25Index, limits: ServerLimits | None = None) -> FastAPI:
    """The app over ``index`` (module docstring)."""
    limits = limits or ServerLimits()
    app = FastAPI(title="hybridflow retrieval (Search-R1's API)")

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "documents": len(index.documents),
            "topk_max": limits.topk_max,
            "max_queries": limits.max_queries,
        }

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Any:
        query = parse_request(await read_body(request, limits.max_request_bytes), limits)
        try:
            ranked = await asyncio.to_thread(index.search, query.queries, query.topk)
        except Exception as error:  # the server's own bug: this request fails, the server goes on
            logger.exception("retrieve failed")
            return JSONResponse(status_code=500, content={"detail": f"{type(error).__name__}: {error}"})
        if query.return_scores:
            result = [[{"document": d.as_dict(), "score": s} for d, s in hits] for hits in ranked]
        else:
            result = [[d.as_dict() for d, _ in hits] for hits in ranked]
        return {"result": result}

    return app
