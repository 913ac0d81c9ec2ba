"""What the routers and the ingress of one process share: the replicas there are, their last
reports (for `/metrics`) and the replicas to avoid. A module of its own because Ray pickles a
custom router's module by value (`RequestRouterConfig`), so state kept there would be a copy."""

from __future__ import annotations

import time
from typing import Any

# model -> replica id -> its last routing stats.
_REPORTS: dict[str, dict[str, dict[str, Any]]] = {}
# model -> replica id -> until when no request goes there (its engine died; Serve replaces it).
_AVOID: dict[str, dict[str, float]] = {}
AVOID_S = 60.0
# model -> replica id -> the requests its router has in flight there (its load term).
_LOADS: dict[str, dict[str, int]] = {}
# model -> the ids of its running replicas, as its router last heard from Serve.
_LIVE: dict[str, list[str]] = {}


def replica_reports() -> dict[str, dict[str, dict[str, Any]]]:
    return _REPORTS


def model_reports(model: str) -> dict[str, dict[str, Any]]:
    return _REPORTS.setdefault(model, {})


def router_loads(model: str) -> dict[str, int]:
    """The router's in-flight count per replica of `model` (the router updates it in place)."""
    return _LOADS.setdefault(model, {})


def all_router_loads() -> dict[str, dict[str, int]]:
    return _LOADS


def avoid_replica(model: str, replica_id: str) -> None:
    _AVOID.setdefault(model, {})[replica_id] = time.monotonic() + AVOID_S


def avoided(model: str, now: float) -> set[str]:
    return {rid for rid, until in _AVOID.get(model, {}).items() if until > now}


def set_live_replicas(model: str, replica_ids: list[str]) -> None:
    _LIVE[model] = list(replica_ids)


def live_replicas(model: str) -> list[str]:
    """Every replica of `model` (an admin request goes to each of them)."""
    return list(_LIVE.get(model, ()))
