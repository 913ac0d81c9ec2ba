"""`slotserve serve --data-parallel-size N`: N replicas of one model on Ray Serve, behind one
endpoint. A local Ray cluster with this machine's cores is started (and stopped at exit)
unless `--ray-address` joins one; Ctrl-C and SIGTERM stop the app, Serve and that cluster.

On the local cluster the ingress serves `--port` itself (Ray Serve's direct ingress): no
proxy actor relays every request and streamed message to it, which on 2 cores cost about as
much CPU as the ingress itself (docs/RAY.md). Serve still starts its proxy on the head node;
it listens on another free port, which nothing is sent to."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from typing import Any

from slotserve.entrypoints.openai.limits import ServerLimits
from slotserve.routing.policy import RouterPolicy

logger = logging.getLogger("slotserve.serve")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's settings (read when `ray.serve` is imported, here and in the workers the
    local cluster starts) for an ingress replica serving `port` itself; a replica asks for a
    port in [min, max), so the ranges are one port wide plus one."""
    grpc = free_port()
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc + 1),
            # Stopping waits this long for open connections (30 s by default).
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


def serve_replicas(*, engine_kwargs: dict[str, Any], served_model_name: str,
                   num_replicas: int, router: RouterPolicy, threads: int | None,
                   ray_address: str | None, host: str, port: int, api_key: str | None,
                   limits: ServerLimits, tool_call_parser: str | None,
                   enable_admin: bool = False, admin_api_key: str | None = None,
                   stream_interval: int = 1, stop: threading.Event | None = None) -> int:
    cores = available_cores()
    local = ray_address is None
    proxy_port = port
    if local:
        os.environ.update(direct_ingress_env(port))
        # Serve's controller checks its deployments 10 times a second by default: on 2
        # cores that was 0.8 CPU s of a 17 s run, taken from the engines (docs/RAY.md).
        os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "1")
        proxy_port = free_port()

    import ray
    from ray import serve

    from slotserve.ray.app import build_app

    per_replica = threads if threads and threads > 0 else max(1, cores // num_replicas)
    stop = stop or threading.Event()
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda *_: stop.set())
                for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    ray.init(address=ray_address, num_cpus=cores if local else None, include_dashboard=False,
             logging_level=logging.WARNING, configure_logging=False)
    try:
        # The ingress serves `host` too (Serve's HTTP options are the direct ingress's).
        serve.start(http_options={"host": host, "port": proxy_port})
        app = build_app(models=[{
            "name": served_model_name, "engine_kwargs": engine_kwargs,
            "num_replicas": num_replicas, "router": router, "threads": per_replica,
            # On the local cluster the replicas share its cores evenly.
            "num_cpus": cores / num_replicas if local else float(per_replica),
            "tool_call_parser": tool_call_parser, "stream_interval": stream_interval,
            "pin_cores": local}],
            api_key=api_key, limits=limits, enable_admin=enable_admin, admin_api_key=admin_api_key)
        serve.run(app, name="slotserve", route_prefix="/")
        logger.info("serving %s on %d replicas (%s router, %d torch threads each) on "
                    "http://%s:%d", served_model_name, num_replicas, router, per_replica,
                    host, port)
        stop.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        serve.shutdown()
        ray.shutdown()
    return 0
