"""A least-in-flight HTTP router in front of served replicas (verl's reward-loop ``NaiveRouter``):
``python -m hybridflow.serve.router --port P --upstream http://127.0.0.1:A --upstream http://127.0.0.1:B``.

Every request (any path, GET or POST) goes to the replica with the fewest requests in flight through this
router (ties: the fewest sent so far, then the first), the same rule as the agent loop's
``AsyncLLMServerManager``; its body and headers (the API key included) are passed on, and the replica's
status, body and ``content-type`` / ``retry-after`` come back as they are, so a 401 or a 503 +
Retry-After reaches the client to handle (:mod:`hybridflow.utils.served_client`). A replica that cannot
be reached is a 502 naming it; the router does not retry (the client decides). ``GET /health`` is the
router's own; ``GET /router/stats`` gives each replica's in-flight and sent counts.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations (Request) at build time
import argparse
import json


class LeastInFlight:
    """Which upstream takes the next request, and the counts that decide it."""

    def __init__(self, upstreams: list[str]) -> None:
        if not upstreams:
            raise ValueError("the router needs at least one --upstream")
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self.in_flight = [0] * len(upstreams)
        self.sent = [0] * len(upstreams)

    def acquire(self) -> int:
        index = min(range(len(self.upstreams)), key=lambda i: (self.in_flight[i], self.sent[i], i))
        self.in_flight[index] += 1
        self.sent[index] += 1
        return index

    def release(self, index: int) -> None:
        self.in_flight[index] -= 1


def build_router_app(upstreams: list[str], timeout_s: float | None = None):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    policy = LeastInFlight(upstreams)
    app = FastAPI(title="hybridflow.serve.router")
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=httpx.Limits(max_connections=1024))
    passed_back = ("content-type", "retry-after", "www-authenticate")

    @app.get("/health")
    async def health():
        return {"status": "ok", "upstreams": len(policy.upstreams)}

    @app.get("/router/stats")
    async def stats():
        return {"upstreams": policy.upstreams, "in_flight": policy.in_flight, "sent": policy.sent}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request):
        index = policy.acquire()
        url = f"{policy.upstreams[index]}/{path}"
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        try:
            answer = await client.request(request.method, url, content=await request.body(), headers=headers)
        except httpx.HTTPError as error:
            message = (
                f"replica {index} ({policy.upstreams[index]}) could not be reached: {type(error).__name__}"
            )
            body = {"error": {"message": message, "type": "bad_gateway", "param": None, "code": None}}
            return JSONResponse(body, status_code=502)
        finally:
            policy.release(index)
        kept = {k: v for k, v in answer.headers.items() if k.lower() in passed_back}
        return Response(answer.content, status_code=answer.status_code, headers=kept)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m hybridflow.serve.router", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--upstream", action="append", required=True, help="a replica's http://host:port")
    parser.add_argument("--timeout-s", type=float, default=None, help="per forwarded request (default: none)")
    args = parser.parse_args(argv)
    print(
        f"hybridflow.serve.router on http://{args.host}:{args.port}: {json.dumps(args.upstream)}", flush=True
    )
    uvicorn.run(
        build_router_app(args.upstream, args.timeout_s), host=args.host, port=args.port, log_level="warning"
    )


if __name__ == "__main__":
    main()
