"""The Ray Serve request router of the LLMServer deployments: `RoutingPolicy` behind Ray's
public custom-router API (`ray.serve.request_router.RequestRouter`).

Ray runs one router per deployment handle, in the process that holds the handle (here the
ingress). The request's block hashes are the first argument of `LLMServer.handle_http`; the
router ranks the candidates with the policy (each replica its own rank, so Ray falls through
to the next when one is full) and learns from where Ray sent the request. Replicas report what
their prefix cache holds through `record_routing_stats`; those reports correct the policy's
view and are kept (in `state.py`) for the ingress's `/metrics`.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from slotserve.ray.outbox import DRAIN_METHOD
from slotserve.ray.state import avoided, model_reports, router_loads, set_live_replicas
from slotserve.routing.policy import (
    InFlight,
    PolicyConfig,
    Reservations,
    RouterPolicy,
    RoutingPolicy,
)

# A replica that reports an empty queue and was sent nothing for this long holds none of this
# router's requests: a count above zero then is a completion Ray never reported, and left
# alone it would steer every cold request away from that replica for good.
STALE_INFLIGHT_S = 3.0
MAX_UNCOUNTED = 1024


def _route_of(pending: PendingRequest | None) -> list[bytes] | str:
    """The first argument of every LLMServer call: the request's block hashes, or the id of
    the one replica it must go to (a session's messages, an admin request's fan-out)."""
    if pending is None or not pending.args:
        return []
    first = pending.args[0]
    return first if isinstance(first, (list, str)) else []


def _hashes_of(pending: PendingRequest | None) -> list[bytes]:
    route = _route_of(pending)
    return route if isinstance(route, list) else []


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, policy: RouterPolicy = "prefix", model: str = "",
                         imbalanced_threshold: int = 8, load_weight: float = 0.1,
                         seed: int | None = None, **_: Any) -> None:
        self._policy = RoutingPolicy(policy, PolicyConfig(
            imbalanced_threshold=imbalanced_threshold, load_weight=load_weight), seed=seed)
        self._model = model
        # The router's in-flight requests per replica (its load term); the counts are shared
        # with the ingress's /metrics.
        self._inflight = InFlight(router_loads(model))
        # Decisions Ray has not confirmed yet (Reservations says why they count as load).
        self._reserved = Reservations()
        self._last_routed: dict[str, float] = {}
        self._seen_stats: dict[str, int] = {}
        # The pumps' calls (`outbox.Mux`), oldest first; bounded, since one that completed
        # before Ray reported it routed is never taken out.
        self._uncounted: dict[str, None] = {}
        set_live_replicas(model, getattr(self, "_live", []))

    def _absorb_reports(self, replicas: list[RunningReplica]) -> None:
        now = time.monotonic()
        reports = model_reports(self._model)
        live = {r.replica_id.unique_id for r in replicas}
        for r in replicas:
            stats = r.routing_stats
            rid = r.replica_id.unique_id
            if stats and id(stats) != self._seen_stats.get(rid):
                self._seen_stats[rid] = id(stats)
                self._policy.index.report(rid, stats.get("hashes", ()), now)
                reports[rid] = stats
                if (stats.get("queue") == 0 and self._inflight.loads.get(rid)
                        and now - self._last_routed.get(rid, 0.0) > STALE_INFLIGHT_S):
                    self._inflight.clear(rid)
        for rid in [k for k in reports if k not in live]:
            del reports[rid]
        self._policy.index.retain(live)
        for rid in [k for k in self._inflight.loads if k not in live]:
            self._inflight.clear(rid, gone=True)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._live = [r.replica_id.unique_id for r in replicas]
        if hasattr(self, "_policy"):  # Ray may list replicas before initialize_state
            set_live_replicas(self._model, self._live)
            self._absorb_reports(replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        pinned = _route_of(pending_request)
        if isinstance(pinned, str):  # that replica or none (the ingress times out)
            return [[by_id[pinned]]] if pinned in by_id else []
        avoid = avoided(self._model, time.monotonic())
        healthy = [rid for rid in by_id if rid not in avoid]
        if healthy:  # with none left, the request waits on one of them rather than fail here
            by_id = {rid: by_id[rid] for rid in healthy}
        now = time.monotonic()
        self._reserved.expire(now)
        loads = {rid: self._inflight.loads.get(rid, 0) + self._reserved.count(rid)
                 for rid in by_id}
        ranking = self._policy.rank(_hashes_of(pending_request), list(by_id), loads)
        if ranking:
            self._reserved.reserve(ranking[0], now)
        return [[by_id[rid]] for rid in ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        rid = replica_id.unique_id
        if pending_request.metadata.call_method == DRAIN_METHOD:  # not load
            self._uncounted[pending_request.metadata.internal_request_id] = None
            while len(self._uncounted) > MAX_UNCOUNTED:
                del self._uncounted[next(iter(self._uncounted))]
            return
        now = time.monotonic()
        if not isinstance(_route_of(pending_request), str):  # pinned ones reserved nothing
            self._reserved.settle(rid, now)
        self._policy.routed(rid, _hashes_of(pending_request), now)
        self._last_routed[rid] = now
        self._inflight.routed(pending_request.metadata.internal_request_id, rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._uncounted.pop(internal_request_id, False) is None:
            return
        self._inflight.completed(internal_request_id, replica_id.unique_id, time.monotonic())
