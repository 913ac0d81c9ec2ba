"""`slotserve serve` (the OpenAI-compatible server) and `slotserve bench serve` (its load
generator, benchmarks/serve_bench.py), plugged into the `slotserve` command line."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

from slotserve.entrypoints.cli import add_engine_arguments, engine_kwargs_from_args, set_threads

logger = logging.getLogger("slotserve.serve")

BENCH_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_bench.py"
DEFAULT_MODEL_NAME = "slotserve-default"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SLOTSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every endpoint but /health "
                        "(default: $SLOTSERVE_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model as given)")
    p.add_argument("--max-request-body-bytes", type=int, default=None)
    p.add_argument("--engine-mode", choices=("process", "thread"), default="process",
                   help="run the engine loop in a child process (default; it never shares a "
                        "GIL with the HTTP side) or on a thread of the server process")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model or DEFAULT_MODEL_NAME


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from slotserve.entrypoints.async_llm import AsyncLLM
    from slotserve.entrypoints.openai.api_server import DEFAULT_MAX_BODY_BYTES, build_app
    from slotserve.errors import SlotServeError

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = set_threads(args.threads)
    try:
        engine = AsyncLLM.from_engine_args(**engine_kwargs_from_args(args),
                                           engine_mode=args.engine_mode, threads=threads)
    except SlotServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = served_model_name(args)
    app = build_app(engine, served_model_names=[name], api_key=args.api_key,
                    max_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES)
    logger.info("serving %s (max_model_len %d, %d torch threads, engine in a %s) on "
                "http://%s:%d%s", name, engine.max_model_len, threads, args.engine_mode,
                args.host, args.port,
                " with an API key" if args.api_key else "")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_keep_alive=30)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        pass  # uvicorn re-raises Ctrl-C after a clean shutdown
    finally:
        engine.shutdown()  # idempotent; the app's lifespan normally did it already
    return 0


def load_bench_module() -> ModuleType:
    """benchmarks/serve_bench.py lives outside the package, next to the other benchmarks."""
    if not BENCH_SCRIPT.is_file():
        raise SystemExit(f"{BENCH_SCRIPT} not found: `slotserve bench serve` needs a source "
                         "checkout of slotserve")
    spec = importlib.util.spec_from_file_location("slotserve_serve_bench", BENCH_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run_bench(args: argparse.Namespace) -> int:
    return int(load_bench_module().main(args) or 0)


def register_subcommands(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_server)

    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench_serve = bench_sub.add_parser(
        "serve", help="load-test a server (or one started on the bundled model)")
    if BENCH_SCRIPT.is_file():
        load_bench_module().add_cli_args(bench_serve)
    bench_serve.set_defaults(func=_run_bench)


# The name the lead's brief used; cli.py calls register_subcommands.
add_subcommands = register_subcommands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slotserve serve")
    add_serve_arguments(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
