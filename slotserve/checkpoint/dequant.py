"""The one step between a checkpoint tensor and a model parameter: GGUF data is dequantized
to the compute dtype (with `gguf`'s own numpy kernels, except Q8_0, below); torch tensors are
only cast.

Keeping this a single function is deliberate: keeping weights quantized in memory
(`models/quantization.py`) replaces this step, for the tensors a quantized kernel can run,
with `copy_blocks`, and nothing else.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from slotserve.checkpoint.gguf_file import GGUFTensor, drop_pages as _drop_pages

CheckpointTensor = torch.Tensor | GGUFTensor


def _q8_0(data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Q8_0 (blocks of a float16 scale and 32 int8 values) in torch: bit-identical to gguf's
    numpy kernel and 5x faster, which matters because large-vocabulary files keep their
    embedding in Q8_0 (72% of the Gemma 3 270M file)."""
    with warnings.catch_warnings():  # the file map is read-only, and only read here
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        blocks = torch.from_numpy(np.ascontiguousarray(data)).view(-1, 34)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(scale).view(shape)


def gguf_type(tensor: CheckpointTensor) -> int | None:
    """The GGML type id of a tensor still in its GGUF form (None for a torch tensor)."""
    return None if isinstance(tensor, torch.Tensor) else int(tensor.ggml_type)


def copy_blocks(tensor: GGUFTensor, out: torch.Tensor) -> None:
    """Copy a block-typed tensor's bytes, as stored, into `out` (uint8 [rows, bytes per row]
    on the CPU): the weight then lives in memory of its own, not in the file's map."""
    data = tensor.data.reshape(out.shape)
    np.copyto(out.numpy(), data, casting="no")
    if isinstance(tensor.data, np.memmap):
        _drop_pages(tensor.data)


def map_blocks(tensor: GGUFTensor, shape: tuple[int, int]) -> torch.Tensor | None:
    """A block-typed tensor's bytes, as stored, as a uint8 [rows, bytes per row] tensor on
    the file's map (no copy: the page cache's pages are the weight, as with llama.cpp's mmap,
    so the process holds no second copy and the pages come back to it after a restart).
    Read-only, which the kernels are: they never write weights. None when the data is not
    plain bytes in a map (copy it then)."""
    data = tensor.data
    if data.dtype != np.uint8 or not isinstance(data, np.memmap):
        return None
    with warnings.catch_warnings():  # the map is read-only; nothing writes weight blocks
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(data.reshape(shape))


def materialize(tensor: CheckpointTensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(tensor, torch.Tensor):
        return tensor.to(dtype)
    if tensor.ggml_type == GGMLQuantizationType.Q8_0:
        return _q8_0(tensor.data, tensor.shape).to(dtype)
    values = dequantize(tensor.data, tensor.ggml_type).reshape(tensor.shape)
    if not values.flags.writeable:  # an F32 tensor is a view of the read-only file map
        values = np.array(values)
    return torch.from_numpy(values).to(dtype)
