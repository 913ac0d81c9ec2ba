"""Session-wide test setup."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What slotserve caches per checkpoint file goes to a folder of this session (unless the
    caller chose one), so tests never read or fill the user's ~/.cache."""
    if os.environ.get("SLOTSERVE_CACHE_DIR"):
        yield
        return
    os.environ["SLOTSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("slotserve-cache"))
    try:
        yield
    finally:
        del os.environ["SLOTSERVE_CACHE_DIR"]
