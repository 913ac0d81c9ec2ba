"""`slotserve serve --data-parallel-size N`: N replicas of one model on Ray Serve, behind one
endpoint. A local Ray cluster with this machine's cores is started (and stopped at exit)
unless `--ray-address` joins one; Ctrl-C and SIGTERM stop the app, Serve and that cluster."""

from __future__ import annotations

import logging
import os
import signal
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


def serve_replicas(*, engine_kwargs: dict[str, Any], served_model_name: str,
                   num_replicas: int, router: RouterPolicy, threads: int | None,
                   ray_address: str | None, host: str, port: int, api_key: str | None,
                   limits: ServerLimits, tool_call_parser: str | None,
                   enable_admin: bool = False, admin_api_key: str | None = None,
                   stream_interval: int = 1, stop: threading.Event | None = None) -> int:
    import ray
    from ray import serve

    from slotserve.ray.app import build_app

    cores = available_cores()
    local = ray_address is None
    per_replica = threads if threads and threads > 0 else max(1, cores // num_replicas)
    stop = stop or threading.Event()
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda *_: stop.set())
                for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    ray.init(address=ray_address, num_cpus=cores if local else None, include_dashboard=False,
             logging_level=logging.WARNING, configure_logging=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        app = build_app(models=[{
            "name": served_model_name, "engine_kwargs": engine_kwargs,
            "num_replicas": num_replicas, "router": router, "threads": per_replica,
            # On the local cluster the replicas share its cores evenly.
            "num_cpus": cores / num_replicas if local else float(per_replica),
            "tool_call_parser": tool_call_parser, "stream_interval": stream_interval}],
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
