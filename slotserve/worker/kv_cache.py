"""The paged KV cache: per layer a K and a V tensor [num_blocks, block_size, kv_heads, row],
a row being one token's head in the `--kv-cache-dtype` storage (models/kv_storage.py).

Block 0 is the null block: the scheduler never hands it to a request, and the decode batch
points its padding at it. The cache is zero-filled, because masked attention positions still
enter the P @ V product (0 * NaN would poison a row if memory held garbage).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from slotserve.model_config import ModelConfig
from slotserve.models.kv_storage import row_bytes, row_elems
from slotserve.worker import kv_budget

logger = logging.getLogger(__name__)

def block_bytes(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V, stored as `kv_dtype`
    (models/kv_storage.py: int8 rows carry their scale)."""
    return kv_budget.block_bytes(cfg, block_size, row_bytes(cfg.head_dim, kv_dtype))


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return kv_budget.available_host_memory()


def determine_num_blocks(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype,
                         device: torch.device, num_blocks: int | None,
                         kv_cache_memory: int | float | None, max_num_seqs: int,
                         max_model_len: int) -> int:
    """`num_blocks` if given, else derived from a budget (bytes, or a fraction of free memory):
    kv_budget.determine_num_blocks for a cache stored as `kv_dtype` on `device`."""
    return kv_budget.determine_num_blocks(
        block_bytes(cfg, block_size, kv_dtype), block_size, num_blocks, kv_cache_memory,
        max_num_seqs, max_model_len, lambda: available_memory(device), device.type == "cuda")


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
