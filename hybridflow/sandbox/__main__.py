"""``python -m hybridflow.sandbox serve [--host H] [--port P] [limits...]``: the SandboxFusion server.

Point verl's ``sandbox_fusion_url`` (the tool config) or ``reward_model.sandbox_fusion.url`` at
``http://H:P/run_code``. ``python -m hybridflow.sandbox languages`` lists what this machine runs.
"""

from __future__ import annotations

import argparse
import sys

from hybridflow.sandbox.runner import ServerLimits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.sandbox", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("languages", help="print the languages this machine can run, one a line")
    serve = commands.add_parser("serve", help="serve POST /run_code (SandboxFusion's API)")
    defaults = ServerLimits()
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="runs at once, the rest wait (default: 64, or 4 per CPU)",
    )
    serve.add_argument(
        "--max-timeout-s",
        type=float,
        default=defaults.max_timeout_s,
        help="cap on each step's compile_timeout / run_timeout",
    )
    serve.add_argument(
        "--max-memory-mb",
        type=int,
        default=defaults.max_memory_mb,
        help="cap on memory_limit_MB, and the limit when a request gives none (<= 0)",
    )
    serve.add_argument(
        "--output-limit-bytes",
        type=int,
        default=defaults.output_limit_bytes,
        help="bytes kept of each step's stdout and of its stderr",
    )
    serve.add_argument(
        "--max-file-mb", type=int, default=defaults.max_file_mb, help="one file written by a run, at most"
    )
    serve.add_argument(
        "--max-disk-mb", type=int, default=defaults.max_disk_mb, help="all files a run writes (in memory)"
    )
    serve.add_argument(
        "--max-fetch-mb", type=int, default=defaults.max_fetch_mb, help="fetch_files returned, in all"
    )
    serve.add_argument("--max-processes", type=int, default=defaults.max_processes)
    serve.add_argument(
        "--site-packages",
        action="store_true",
        help="let Python code import the packages installed for this server's interpreter",
    )
    serve.add_argument("--work-root", default=None, help="host directory for each run's small scratch dir")
    serve.add_argument("--max-request-bytes", type=int, default=64 << 20)
    serve.add_argument("--log-level", default="warning")
    return parser.parse_args(argv)


def limits_from(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_timeout_s=args.max_timeout_s,
        max_memory_mb=args.max_memory_mb,
        output_limit_bytes=args.output_limit_bytes,
        max_file_mb=args.max_file_mb,
        max_disk_mb=args.max_disk_mb,
        max_fetch_mb=args.max_fetch_mb,
        max_processes=args.max_processes,
        site_packages=args.site_packages,
        work_root=args.work_root,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "languages":
        from hybridflow.sandbox.languages import available_languages

        print("\n".join(available_languages()))
        return
    try:
        import uvicorn
    except ImportError:
        sys.exit(
            "python -m hybridflow.sandbox serve needs uvicorn and fastapi: pip install hybridflow[serve]"
        )
    from hybridflow.sandbox.app import create_app

    app = create_app(limits_from(args), args.max_concurrency, args.max_request_bytes)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
