"""How many KV blocks a budget buys (`--kv-cache-memory`, `--num-blocks`), from the bytes a
block takes: torch-free, for the torch runner's cache (worker/kv_cache.py) and the native
runner's alike."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

from slotserve.errors import ConfigError
from slotserve.model_config import ModelConfig

logger = logging.getLogger(__name__)

# With no budget at all, the CPU default is a quarter of available RAM, but at most 4 GiB:
# zero-filling tens of GiB would stall start-up for blocks the CPU cannot use anyway.
CPU_DEFAULT_FRACTION = 0.25
CPU_DEFAULT_CAP = 4 << 30
CUDA_DEFAULT_FRACTION = 0.9


def block_bytes(cfg: ModelConfig, block_size: int, row_bytes: int) -> int:
    """Bytes one block takes across all layers, K and V, a token's head taking `row_bytes`."""
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * row_bytes


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def determine_num_blocks(per_block: int, block_size: int, num_blocks: int | None,
                         kv_cache_memory: int | float | None, max_num_seqs: int,
                         max_model_len: int, available: Callable[[], int], cuda: bool) -> int:
    """`num_blocks` if given, else derived from a budget (bytes, or a fraction of
    `available()` memory) for blocks of `per_block` bytes."""
    if num_blocks is not None:
        logger.info("KV cache: %d blocks of %d tokens (configured), %.1f MiB",
                    num_blocks, block_size, num_blocks * per_block / 2**20)
        return num_blocks

    # Enough blocks for every slot to hold a full-length sequence, plus the null block: more
    # than this is only useful as prefix-cache room, so the default budget stops there.
    useful = max_num_seqs * math.ceil(max_model_len / block_size) + 1
    if kv_cache_memory is None:
        avail = available()
        if cuda:
            budget = int(avail * CUDA_DEFAULT_FRACTION)
            how = f"default {CUDA_DEFAULT_FRACTION:.0%} of {avail / 2**30:.2f} GiB free"
        else:
            budget = min(int(avail * CPU_DEFAULT_FRACTION), CPU_DEFAULT_CAP)
            how = (f"default min({CPU_DEFAULT_FRACTION:.0%} of {avail / 2**30:.2f} GiB "
                   f"available, {CPU_DEFAULT_CAP / 2**30:.0f} GiB)")
        derived = min(budget // per_block, useful)
    elif isinstance(kv_cache_memory, float):
        if not 0.0 < kv_cache_memory <= 1.0:
            raise ConfigError(f"kv_cache_memory fraction must be in (0, 1], "
                                 f"got {kv_cache_memory}")
        avail = available()
        budget = int(avail * kv_cache_memory)
        how = f"{kv_cache_memory:.0%} of {avail / 2**30:.2f} GiB available"
        derived = budget // per_block
    else:
        budget = int(kv_cache_memory)
        how = f"{budget} bytes requested"
        derived = budget // per_block
    if derived < 2:
        raise ConfigError(f"KV cache budget too small: {how} gives {derived} blocks of "
                             f"{per_block} bytes; at least 2 are needed (block 0 is reserved)")
    logger.info("KV cache: %d blocks of %d tokens = %.1f MiB (%s; %d bytes per block; "
                "%d blocks would hold every slot at max_model_len)", derived, block_size,
                derived * per_block / 2**20, how, per_block, useful)
    return int(derived)
