"""The Ray tests that start a local cluster take turns across pytest-xdist workers: each checks
at its end that no Ray process is left on the machine, which the other worker's cluster would
break (seen running tests/ray on two workers: test_launch found the other's gcs_server)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from filelock import FileLock


@pytest.fixture(scope="module")
def ray_turn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Held while a module's Ray cluster runs (one test session's workers share the lock)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with FileLock(str(tmp_path_factory.getbasetemp().parent / "ray_cluster.lock")):
        yield
