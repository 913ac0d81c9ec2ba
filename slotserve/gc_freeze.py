"""Moving what startup built out of the garbage collector's sight.

A full (generation 2) collection walks every tracked container: after startup that is the
model's modules and parameters, the tokenizer's vocabulary, FastAPI's routes and pydantic's
validators, hundreds of thousands of objects that live until exit. Every pass over them is a
pause on the thread that happens to allocate (a step, or a response being written): the p99
spikes of a long-running server. `gc.freeze()` moves every object alive now to a permanent
generation that collections skip; objects created later are collected as before, and frozen
ones that lose their last reference are still freed by reference counting. A cycle of frozen
objects would stay, though: an engine built and dropped in one process (tests, the offline
LLM, a server's lifespan ending) would keep its model. So whoever froze thaws when what it
froze for ends (`thaw()`), and the cycles become collectable again.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_long_lived(where: str) -> int:
    """Collect what startup left as garbage (so that is not frozen for good), then freeze
    everything alive. Returns the number of objects frozen in total."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    logger.debug("%s: %d long-lived objects frozen out of GC passes (%.0f ms)", where, count,
                 (time.perf_counter() - start) * 1e3)
    return count


def thaw() -> None:
    """Give the frozen objects back to the collector (the oldest generation)."""
    gc.unfreeze()
