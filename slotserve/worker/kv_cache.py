"""The paged KV cache: per layer a K and a V tensor [num_blocks, block_size, kv_heads, row],
a row being one token's head in the `--kv-cache-dtype` storage (models/kv_storage.py).

Block 0 is the null block: the scheduler never hands it to a request, and the decode batch
points its padding at it. The cache is zero-filled, because masked attention positions still
enter the P @ V product (0 * NaN would poison a row if memory held garbage).
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import torch

from slotserve.errors import ConfigError
from slotserve.model_config import ModelConfig
from slotserve.models.kv_storage import row_bytes, row_elems

logger = logging.getLogger(__name__)

# With no budget at all, the CPU default is a quarter of available RAM, but at most 4 GiB:
# zero-filling tens of GiB would stall start-up for blocks the CPU cannot use anyway.
CPU_DEFAULT_FRACTION = 0.25
CPU_DEFAULT_CAP = 4 << 30
CUDA_DEFAULT_FRACTION = 0.9


def block_bytes(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V, stored as `kv_dtype`
    (models/kv_storage.py: int8 rows carry their scale)."""
    return (2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads
            * row_bytes(cfg.head_dim, kv_dtype))


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def determine_num_blocks(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype,
                         device: torch.device, num_blocks: int | None,
                         kv_cache_memory: int | float | None, max_num_seqs: int,
                         max_model_len: int) -> int:
    """`num_blocks` if given, else derived from a budget (bytes, or a fraction of free memory)."""
    per_block = block_bytes(cfg, block_size, kv_dtype)
    if num_blocks is not None:
        logger.info("KV cache: %d blocks of %d tokens (configured), %.1f MiB",
                    num_blocks, block_size, num_blocks * per_block / 2**20)
        return num_blocks

    # Enough blocks for every slot to hold a full-length sequence, plus the null block: more
    # than this is only useful as prefix-cache room, so the default budget stops there.
    useful = max_num_seqs * math.ceil(max_model_len / block_size) + 1
    if kv_cache_memory is None:
        avail = available_memory(device)
        if device.type == "cuda":
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
        avail = available_memory(device)
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


# numpy integer dtype of each torch dtype's width: zero bits are 0.0 in every float format.
_SAME_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros. On the CPU through numpy's calloc, which takes fresh pages that the kernel
    zero-fills on first touch: torch.zeros writes every byte up front (1.4 s and 4 GiB of
    resident memory for the default 4 GiB cache, most of which a short run never touches)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    width = torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(shape, dtype=_SAME_WIDTH[width])).view(dtype)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int,
                      kv_dtype: torch.dtype, device: torch.device
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer K and V [num_blocks, block_size, kv_heads, row] in the storage type."""
    shape = (num_blocks, block_size, cfg.num_key_value_heads, row_elems(cfg.head_dim, kv_dtype))
    return [(_zeros(shape, kv_dtype, device), _zeros(shape, kv_dtype, device))
            for _ in range(cfg.num_hidden_layers)]
