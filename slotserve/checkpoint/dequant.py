"""The one step between a checkpoint tensor and a model parameter: GGUF data is dequantized
(with `gguf`'s own numpy kernels) to the compute dtype; torch tensors are only cast.

Keeping this a single function is deliberate: keeping weights quantized in memory replaces
this step for the tensors a quantized kernel can run, and nothing else.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.quants import dequantize

from slotserve.checkpoint.gguf_file import GGUFTensor

CheckpointTensor = torch.Tensor | GGUFTensor


def materialize(tensor: CheckpointTensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(tensor, torch.Tensor):
        return tensor.to(dtype)
    values = dequantize(tensor.data, tensor.ggml_type).reshape(tensor.shape)
    if not values.flags.writeable:  # an F32 tensor is a view of the read-only file map
        values = np.array(values)
    return torch.from_numpy(values).to(dtype)
