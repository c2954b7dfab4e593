"""The HTTP app: SandboxFusion's ``POST /run_code`` over :func:`hybridflow.sandbox.runner.run_code`.

Endpoints: ``POST /run_code`` (:mod:`hybridflow.sandbox.api`), ``GET /v1/ping`` (``"pong"``, as
SandboxFusion) and ``GET /health`` (``{"status": "ok", "languages": [...], "running": n, "waiting": n}``).
At most ``max_concurrency`` requests run at once (default ``DEFAULT_CONCURRENCY``, or 4 per CPU if more:
a run mostly waits, and its time limits are wall-clock, so a short queue matters more than a spare CPU);
the rest wait their turn, and one whose client has gone by then is not run. A body that is not valid
JSON or lacks ``code``/``language`` gets FastAPI's 422, one over ``max_request_bytes`` a 413; anything
else is answered with HTTP 200 and the run's status, ``SandboxError`` included.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations at build time
import asyncio
import logging
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hybridflow.sandbox.api import RunCodeRequest, RunCodeResponse, sandbox_error
from hybridflow.sandbox.languages import available_languages
from hybridflow.sandbox.runner import ServerLimits, run_code

logger = logging.getLogger(__name__)
DEFAULT_CONCURRENCY = 64


def create_app(
    limits: ServerLimits | None = None,
    max_concurrency: int | None = None,
    max_request_bytes: int = 64 << 20,
) -> FastAPI:
    """The app; ``max_concurrency``: runs at once (module docstring)."""
    limits = limits or ServerLimits()
    concurrency = max(1, max_concurrency or max(DEFAULT_CONCURRENCY, 4 * (os.cpu_count() or 1)))
    app = FastAPI(title="hybridflow sandbox (SandboxFusion API)")
    state = {"running": 0, "waiting": 0, "semaphore": None}

    def semaphore() -> asyncio.Semaphore:  # made on the serving loop, at the first request
        if state["semaphore"] is None:
            state["semaphore"] = asyncio.Semaphore(concurrency)
        return state["semaphore"]

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_request_bytes:
            return JSONResponse(
                status_code=413, content={"detail": f"request body over {max_request_bytes} bytes"}
            )
        return await call_next(request)

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "languages": available_languages(),
            "running": state["running"],
            "waiting": state["waiting"],
        }

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code_endpoint(body: RunCodeRequest, request: Request) -> RunCodeResponse:
        state["waiting"] += 1
        admitted = False
        try:
            async with semaphore():
                state["waiting"] -= 1
                admitted = True
                if await request.is_disconnected():  # it gave up while waiting: nobody reads the answer
                    return sandbox_error("the client disconnected before the run started")
                state["running"] += 1
                try:
                    return await run_code(body, limits)
                finally:
                    state["running"] -= 1
        except Exception as error:  # the server's own bug: this request fails, the server goes on
            logger.exception("run_code failed")
            return sandbox_error(f"server error: {type(error).__name__}: {error}")
        finally:
            if not admitted:  # failed or cancelled while waiting
                state["waiting"] -= 1

    return app
