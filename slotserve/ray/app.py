"""`build_app`: the Ray Serve application of one or more models, each an `LLMServer`
deployment (its own replica count, engine arguments and router) behind one `OpenAIIngress`.

From Python: `serve.run(build_app(models=[{"name": "a", "model": PATH, "num_replicas": 2}]))`.
From a Serve config file: `import_path: slotserve.ray:build_app` with the same keywords under
`args:` (Serve passes them as one dict). docs/RAY.md has a two-model config.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from slotserve.engine.args import DEFAULT_MODEL, EngineArgs
from slotserve.entrypoints.openai.limits import ServerLimits
from slotserve.entrypoints.openai.stream_interval import check_stream_interval
from slotserve.errors import ConfigError
from slotserve.ray.ingress import OpenAIIngress
from slotserve.ray.router import PrefixAwareRouter
from slotserve.ray.server import LLMServer
from slotserve.routing.policy import ROUTER_POLICIES, RouterPolicy

# How often replicas report their cache to the router (and their metrics to /metrics).
ROUTING_STATS_PERIOD_S = 1.0
HEALTH_CHECK_PERIOD_S = 2.0
# Serve's replicas and routers export their Ray metrics every 100 ms by default; every
# second is enough for a dashboard and leaves the engines their cores (docs/RAY.md).
SERVE_ENV = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


@dataclass(frozen=True, slots=True)
class ModelDeployment:
    """One model of the app: the name clients send and how its replicas run."""

    name: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    num_replicas: int = 1
    router: RouterPolicy = "prefix"
    # Torch threads of each replica's engine core, and the Ray CPUs each replica reserves.
    threads: int = 1
    num_cpus: float = 1.0
    tool_call_parser: str | None = None
    # SSE events a replica sends on in one message after the first (vLLM's stream_interval):
    # each costs the Ray path per message, not per byte.
    stream_interval: int = 1
    # Bind each replica's engine core to cores of its own (by its rank on the node); for a
    # node whose cores the replicas share alone, as `--data-parallel-size` starts it.
    pin_cores: bool = False

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> ModelDeployment:
        spec = dict(spec)
        kwargs = dict(spec.pop("engine_kwargs", {}))
        if "model" in spec:
            kwargs["model"] = spec.pop("model")
        try:
            EngineArgs.from_kwargs(**kwargs)  # unknown or bad engine arguments fail here
            out = cls(engine_kwargs=kwargs, **spec)
        except TypeError as exc:
            raise ConfigError(f"bad model spec {spec!r}: {exc}") from None
        if out.router not in ROUTER_POLICIES:
            raise ConfigError(f"unknown router {out.router!r}; use one of "
                              f"{', '.join(ROUTER_POLICIES)}")
        if out.num_replicas < 1:
            raise ConfigError("num_replicas must be at least 1")
        check_stream_interval(out.stream_interval)
        return out

    @property
    def model_path(self) -> str:
        return os.path.expanduser(str(self.engine_kwargs.get("model") or DEFAULT_MODEL))


def _deployment_name(name: str) -> str:
    return "LLMServer:" + "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def build_app(args: dict[str, Any] | None = None, *,
              models: Sequence[dict[str, Any] | ModelDeployment] = (),
              api_key: str | None = None, limits: ServerLimits | None = None,
              enable_admin: bool = False, admin_api_key: str | None = None) -> Application:
    """The application; `args` is the dict a Serve config file gives (keys as the keywords).
    `enable_admin`: the admin endpoints of one process (reset the prefix cache, load and
    unload LoRA adapters), on every replica, behind `admin_api_key` (else `api_key`)."""
    if args is not None:
        models = args.get("models", models)
        api_key = args.get("api_key", api_key)
        enable_admin = args.get("enable_admin", enable_admin)
        admin_api_key = args.get("admin_api_key", admin_api_key)
    specs = [m if isinstance(m, ModelDeployment) else ModelDeployment.from_dict(m)
             for m in models]
    if not specs:
        raise ConfigError("build_app needs at least one model")
    if len({s.name for s in specs}) != len(specs):
        raise ConfigError("model names must be unique")
    if api_key == "" or admin_api_key == "":
        raise ConfigError("an API key must not be empty")
    if enable_admin and not (admin_api_key or api_key):
        raise ConfigError("admin endpoints need a key: give admin_api_key or api_key")
    handles = {}
    for spec in specs:
        router_options: dict[str, Any] = {
            "request_router_class": PrefixAwareRouter,
            "request_router_kwargs": {"policy": spec.router, "model": spec.name},
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
            "request_routing_stats_timeout_s": 10.0}
        router = RequestRouterConfig(**router_options)
        deployment = serve.deployment(
            name=_deployment_name(spec.name), num_replicas=spec.num_replicas,
            # Admission control and its 429s are the replica app's business, not Ray's.
            max_ongoing_requests=1024, max_queued_requests=-1,
            health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=5.0, request_router_config=router,
            ray_actor_options={"num_cpus": spec.num_cpus, "runtime_env": {"env_vars": {
                **SERVE_ENV, "OMP_NUM_THREADS": str(spec.threads),
                "TOKENIZERS_PARALLELISM": "false"}}}
        )(LLMServer)
        handles[spec.name] = deployment.bind(spec.engine_kwargs, spec.name,
                                             threads=spec.threads, limits=limits,
                                             tool_call_parser=spec.tool_call_parser,
                                             enable_admin=enable_admin,
                                             admin_api_key=admin_api_key,
                                             stream_interval=spec.stream_interval,
                                             pin_cores=spec.pin_cores)
    ingress = serve.deployment(name="OpenAIIngress", max_ongoing_requests=4096,
                               ray_actor_options={"num_cpus": 0, "runtime_env": {
                                   "env_vars": SERVE_ENV}})(OpenAIIngress)
    return ingress.bind(handles, {s.name: s.model_path for s in specs}, api_key=api_key,
                        limits=limits, admin_api_key=admin_api_key, enable_admin=enable_admin)
