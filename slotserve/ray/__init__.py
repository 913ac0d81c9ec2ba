"""slotserve on Ray Serve: data-parallel engine replicas behind a prefix-cache-aware router,
several models in one app (`pip install "slotserve[ray]"`). The only package that imports
Ray; docs/RAY.md describes it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve import Application


def build_app(args: dict[str, Any] | None = None, **kwargs: Any) -> Application:
    """See `slotserve.ray.app.build_app` (imported on call: importing this package loads no
    Ray)."""
    from slotserve.ray.app import build_app as build

    return build(args, **kwargs)


__all__ = ["build_app"]
