"""``python -m hybridflow.retrieval serve --corpus FILE.jsonl [--host H] [--port P] [limits...]``: the
retrieval server.

Point verl's ``SearchTool`` (``retrieval_service_url`` in the tool config) at ``http://H:P/retrieve``.
The corpus is read and indexed in memory at start; the server answers once it listens (``GET /health``).
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.retrieval", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve POST /retrieve (Search-R1's API) over a jsonl corpus")
    serve.add_argument(
        "--corpus",
        required=True,
        help='jsonl, a line {"id": ..., "contents": "Title\\ntext"} (or "title" and "text" fields)',
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="(verl's example config: 8000)")
    serve.add_argument("--topk", type=int, default=3, help="passages per query when a request gives none")
    serve.add_argument("--topk-max", type=int, default=100, help="a request's topk above this is refused")
    serve.add_argument("--max-queries", type=int, default=256, help="queries in one request, at most")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20)
    serve.add_argument("--log-level", default="warning")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import bm25s  # noqa: F401  (checked here, used by the index)
        import uvicorn
    except ImportError as error:
        sys.exit(
            f"python -m hybridflow.retrieval serve needs bm25s, fastapi and uvicorn ({error}): "
            "pip install hybridflow[serve]"
        )
    from hybridflow.retrieval.app import ServerLimits, create_app
    from hybridflow.retrieval.corpus import BM25Index, read_corpus

    try:
        limits = ServerLimits(args.topk, args.topk_max, args.max_queries, args.max_request_bytes)
        index = BM25Index(read_corpus(args.corpus))
    except ValueError as error:  # a bad limit, or a CorpusError naming the file and line
        sys.exit(f"python -m hybridflow.retrieval serve: {error}")
    print(f"hybridflow.retrieval: {len(index.documents)} documents from {args.corpus}", file=sys.stderr)
    uvicorn.run(create_app(index, limits), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
