"""The `slotserve` command line: `generate` (stream a completion from the bundled model),
`serve` (the OpenAI-compatible server) and `bench serve` (its load generator). Each subcommand
sets `func`, which takes the parsed arguments and returns an exit code."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import types
import typing
from typing import Any, Literal

from slotserve.engine.args import EngineArgs
from slotserve.entrypoints import bench_serve
from slotserve.entrypoints.openai.limits import ServerLimits
from slotserve.entrypoints.openai.stream_interval import check_stream_interval
from slotserve.gil_switch import shorten_switch_interval
from slotserve.memory import page_out_libraries

DEFAULT_PROMPT = "To be, or not"
DEFAULT_MODEL_NAME = "slotserve-default"
logger = logging.getLogger("slotserve.serve")


def default_num_threads() -> int:
    """Cores that are idle right now, at most 8.

    More torch threads than free cores is far worse than too few: OpenMP workers spin
    waiting for descheduled siblings, and a small model's decode step slows down tenfold or
    more on a busy machine. Past a handful of threads small decode batches gain nothing.
    """
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except OSError:
        busy = 0
    return max(1, min(available - busy, 8))


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, its type, default and help read from that table, so a
    new engine argument reaches every subcommand that builds an engine. Unset flags stay
    None: EngineArgs' own default applies."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flags = [f"--{f.name.replace('_', '-')}", *f.metadata["aliases"]]
        help_text = f.metadata["help"]
        if "default" not in help_text:
            help_text += f" (default: {f.default})"
        hint = hints[f.name]
        kind = ([t for t in typing.get_args(hint) if t is not type(None)]
                if isinstance(hint, types.UnionType) else [hint])
        if kind == [bool]:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                               help=help_text)
        elif typing.get_origin(kind[0]) is list:
            group.add_argument(*flags, dest=f.name, nargs="+", help=help_text)
        elif typing.get_origin(kind[0]) is Literal:
            group.add_argument(*flags, dest=f.name, choices=typing.get_args(kind[0]),
                               help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, type=_number if kind == [int, float]
                               else kind[0], help=help_text)
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch CPU threads (default: {default_num_threads()})")


def _number(text: str) -> int | float:
    return float(text) if "." in text or "e" in text.lower() else int(text)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
            if getattr(args, f.name, None) is not None}


def engine_flags(kwargs: dict[str, Any]) -> list[str]:
    """The command-line flags of engine keyword arguments (engine_kwargs_from_args undone)."""
    flags: list[str] = []
    for name, value in kwargs.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def usage_error(message: object) -> int:
    """Say what is wrong with the command line or the engine settings; exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def set_threads(threads: int | None) -> int:
    import torch

    n = threads if threads is not None and threads > 0 else default_num_threads()
    torch.set_num_threads(n)
    return n


def _cmd_generate(args: argparse.Namespace) -> int:
    from slotserve.errors import SlotServeError

    try:
        engine_args = EngineArgs.from_kwargs(**engine_kwargs_from_args(args))
        engine_args.model_path()  # a missing folder fails before seconds of torch imports
    except SlotServeError as exc:
        return usage_error(exc)
    threads = set_threads(args.threads)
    from slotserve.engine.llm_engine import LLMEngine
    from slotserve.engine.processor import PromptType
    from slotserve.outputs import RequestOutputKind
    from slotserve.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        engine = LLMEngine.from_engine_args(engine_args, threads=threads)
        prompt: PromptType = args.prompt
        if args.chat:
            # The model file's template renders within the server's bounds (a child process
            # bounded in time and memory), as the server renders it.
            prompt = engine.processor.render_chat([{"role": "user", "content": args.prompt}])
        engine.add_request("cli-0", prompt, params, output_kind=RequestOutputKind.DELTA)
    except SlotServeError as exc:
        return usage_error(exc)
    out = sys.stdout
    if not args.chat:
        out.write(args.prompt)
        out.flush()
    start, num_tokens, reason = time.monotonic(), 0, None
    while engine.has_unfinished_requests():
        for result in engine.step():
            completion = result.outputs[0]
            num_tokens += len(completion.token_ids)
            if completion.text:
                out.write(completion.text)
                out.flush()
            reason = completion.finish_reason or reason
    out.write("\n")
    out.flush()
    elapsed = time.monotonic() - start
    print(f"[{num_tokens} tokens in {elapsed:.2f} s, {num_tokens / max(elapsed, 1e-9):.1f} "
          f"tok/s, {threads} threads, finish_reason={reason}]", file=sys.stderr)
    return 1 if reason == "error" else 0


def _add_generate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("generate", help="stream a completion to the terminal")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=150)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the chat template")
    add_engine_arguments(p)
    p.set_defaults(func=_cmd_generate)


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SLOTSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every endpoint but /health "
                        "(default: $SLOTSERVE_API_KEY; an empty key is refused)")
    p.add_argument("--enable-admin-endpoints", action="store_true",
                   help="serve /reset_prefix_cache (off by default); it needs the admin key")
    p.add_argument("--admin-api-key", default=os.environ.get("SLOTSERVE_ADMIN_API_KEY"),
                   help="the key of the admin endpoints (default: $SLOTSERVE_ADMIN_API_KEY, "
                        "else --api-key)")
    p.add_argument("--no-webui", action="store_true",
                   help="do not serve the web page at / (GET /v1/engine/state stays)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model as given)")
    lim = p.add_argument_group("limits (README: Limits)")
    d = ServerLimits()
    lim.add_argument("--max-request-body-bytes", type=int, default=d.max_body_bytes,
                     help="larger bodies get 413 (default: 1 MiB + 8 bytes per token one "
                          "client may have waiting, max-waiting-tokens x max-client-share, "
                          "at most 8 MiB)")
    lim.add_argument("--max-ws-message-bytes", type=int, default=d.max_ws_message_bytes,
                     help="a larger WebSocket message closes the session with 1009 "
                          "(default %(default)s)")
    lim.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive_s,
                     metavar="SECONDS", help="close a connection idle this long, before its "
                     "first request or between requests (default %(default)s)")
    lim.add_argument("--timeout-request-read", type=float, default=d.timeout_request_read_s,
                     metavar="SECONDS", help="a request's headers, then its body, must arrive "
                     "within this, else 408 (default %(default)s)")
    lim.add_argument("--max-connections", type=int, default=d.max_connections,
                     help="open connections; past it 503 (default %(default)s)")
    lim.add_argument("--max-waiting-seqs", type=int, default=None,
                     help="sequences accepted but not started; past it 429 (default: 4 x "
                          "--max-num-seqs, at least 64)")
    lim.add_argument("--max-waiting-tokens", type=int, default=None,
                     help="their tokens (prompt + max_tokens); past it 429 (default: "
                          "max-waiting-seqs x max_model_len)")
    lim.add_argument("--max-client-share", type=float, default=d.max_client_share,
                     help="the share of either bound one client may hold (default "
                          "%(default)s)")
    p.add_argument("--engine-mode", choices=("process", "thread"), default="process",
                   help="run the engine core in a child process (default; it never shares a "
                        "GIL with the HTTP side) or on a thread of the server process")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                   help="how the model writes tool calls (default: read from its chat "
                   "template)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="a stream's SSE events go on in batches of N after the first, the "
                   "last never held back (vLLM's stream_interval; default 1: each at once)")
    dp = p.add_argument_group("data parallel (Ray Serve, docs/RAY.md)")
    dp.add_argument("--data-parallel-size", type=int, default=1,
                    help="engine replicas behind the one endpoint (default 1: no Ray)")
    dp.add_argument("--router", choices=("prefix", "pow2", "round_robin"), default="prefix",
                    help="how requests pick a replica (default: prefix-cache affinity)")
    dp.add_argument("--ray-address", default=None,
                    help="join this Ray cluster (default: start a local one)")
    p.set_defaults(func=_cmd_serve)


def server_limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_body_bytes=args.max_request_body_bytes,
        max_ws_message_bytes=args.max_ws_message_bytes,
        timeout_keep_alive_s=args.timeout_keep_alive,
        timeout_request_read_s=args.timeout_request_read,
        max_connections=args.max_connections, max_waiting_seqs=args.max_waiting_seqs,
        max_waiting_tokens=args.max_waiting_tokens, max_client_share=args.max_client_share)


def _cmd_serve(args: argparse.Namespace) -> int:
    from slotserve.errors import SlotServeError

    # Refused before anything starts (and before the server's imports, seconds on a busy
    # machine): an empty key would silently turn authentication off.
    for flag, key in (("--api-key", args.api_key), ("--admin-api-key", args.admin_api_key)):
        if key is not None and not key.strip():
            return usage_error(f"{flag} (or its environment variable) is empty; give a key "
                               "or leave it unset")
    if args.enable_admin_endpoints and not (args.admin_api_key or args.api_key):
        return usage_error("--enable-admin-endpoints needs --admin-api-key or --api-key")
    try:
        limits = server_limits_from_args(args)
        check_stream_interval(args.stream_interval)
    except SlotServeError as exc:
        return usage_error(exc)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.data_parallel_size > 1 or args.ray_address:
        return _serve_on_ray(args, limits)
    import uvicorn

    from slotserve.entrypoints import log_limits
    from slotserve.entrypoints.async_llm import AsyncLLM
    from slotserve.entrypoints.openai.api_server import build_app
    from slotserve.entrypoints.openai.limits import uvicorn_config
    from slotserve.lora.request import parse_lora_modules

    if args.engine_mode == "process":
        # Only the engine child runs torch: importing it here too would cost the server
        # process about 200 MB of resident memory for nothing.
        threads = args.threads if args.threads and args.threads > 0 else default_num_threads()
    else:
        threads = set_threads(args.threads)
    try:
        # The event loop shares the GIL with the tokenizing and schema-checking threads.
        shorten_switch_interval()
        engine = AsyncLLM.from_engine_args(**engine_kwargs_from_args(args),
                                           engine_mode=args.engine_mode, threads=threads)
    except SlotServeError as exc:
        return usage_error(exc)
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    app = build_app(engine, served_model_names=[name], api_key=args.api_key, limits=limits,
                    enable_admin=args.enable_admin_endpoints, admin_api_key=args.admin_api_key,
                    tool_call_parser=args.tool_call_parser, webui=not args.no_webui,
                    lora_modules=parse_lora_modules(args.lora_modules),
                    stream_interval=args.stream_interval)
    logger.info("serving %s (max_model_len %d, %d torch threads, engine core in a %s) on "
                "http://%s:%d%s", name, engine.max_model_len, threads, args.engine_mode,
                args.host, args.port, " with an API key" if args.api_key else "")
    config = uvicorn_config(app, limits, host=args.host, port=args.port,
                            log_level=args.log_level)
    log_limits.install()
    # The app is built: what only startup ran of the libraries need not stay resident.
    page_out_libraries()
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        pass  # uvicorn re-raises Ctrl-C after a clean shutdown
    finally:
        engine.shutdown()  # idempotent; the app's lifespan normally did it already
    return 0


def _serve_on_ray(args: argparse.Namespace, limits: ServerLimits) -> int:
    if args.data_parallel_size < 1:
        print("error: --data-parallel-size must be at least 1", file=sys.stderr)
        return 2
    try:
        from slotserve.ray.launch import serve_replicas
    except ImportError:
        print('error: --data-parallel-size needs Ray: pip install "slotserve[ray]"',
              file=sys.stderr)
        return 2
    kwargs = engine_kwargs_from_args(args)
    return serve_replicas(
        engine_kwargs=kwargs, served_model_name=args.served_model_name or args.model
        or DEFAULT_MODEL_NAME, num_replicas=args.data_parallel_size, router=args.router,
        threads=args.threads, ray_address=args.ray_address, host=args.host, port=args.port,
        api_key=args.api_key, limits=limits, tool_call_parser=args.tool_call_parser,
        enable_admin=args.enable_admin_endpoints, admin_api_key=args.admin_api_key,
        stream_interval=args.stream_interval)


def _add_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    p = bench_sub.add_parser("serve", help="load-test a running server")
    p.add_argument("--model", default=None, help="the model folder the server runs, for the "
                   "prompts' vocabulary (default: the bundled model)")
    bench_serve.add_cli_args(p)
    p.set_defaults(func=bench_serve.main)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description="slotserve LLM engine")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_bench(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
