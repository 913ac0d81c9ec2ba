"""Load a checkpoint (Hugging Face folder or GGUF file) into its model class.

No network and no transformers: `resolve_checkpoint` reads the config and opens a weights
reader; the model is built on the meta device (no memory spent on random initialisation),
its layers whose GGUF tensors a native kernel runs are swapped for quantized ones
(`quantization="auto"`, models/quantization.py), it is materialized on the target device, and
filled by its own `load_weights` from the reader's named tensors: those kept quantized as
stored, every other one dequantized/cast to the compute dtype on the way (`materialize`).
Every failure is a `ModelLoadError` naming the file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from slotserve.checkpoint import resolve_checkpoint
from slotserve.checkpoint.dequant import materialize
from slotserve.config import QuantizationMode, check_mode
from slotserve.errors import ModelLoadError
from slotserve.memory import trim_heap
from slotserve.model_config import ModelConfig
from slotserve.models.layers import DecoderForCausalLM
from slotserve.models.quantization import (
    describe,
    prepare_kernels,
    quantize_modules,
    weight_memory,
)
from slotserve.models.registry import model_class
from slotserve.models.weight_utils import checkpoint_names

logger = logging.getLogger(__name__)

def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]


def materialize_empty(model: DecoderForCausalLM, device: torch.device) -> DecoderForCausalLM:
    """`nn.Module.to_empty`, without its `empty_like` of meta tensors: that runs torch's Python
    reference ops, whose first use imports sympy and torch.fx (34 MB resident for the life of
    the process, for nothing the engine uses)."""
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))  # type: ignore[no-untyped-call]  # torch leaves it untyped
    return model


def load_model(path: str | Path, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, max_positions: int | None = None,
               quantization: QuantizationMode | str = "auto",
               ) -> tuple[DecoderForCausalLM, ModelConfig]:
    """`quantization`: "auto" keeps what a native kernel runs in the file's blocks (8-bit
    activations), "exact" too (float32 activations), "none" dequantizes every tensor (the
    reference path)."""
    mode = check_mode(quantization)
    ckpt = resolve_checkpoint(path)
    cfg = ckpt.config
    model_cls = model_class(cfg.architecture)
    torch_dtype = parse_dtype(dtype)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    with torch.device("meta"):
        model = model_cls(cfg)
    model.to_dtype(torch_dtype)
    names = [ckpt_name for parts in checkpoint_names(model).values() for ckpt_name, _ in parts]
    kept = quantize_modules(model, ckpt.reader.tensor_types(names), mode, torch_dtype, dev)
    model = materialize_empty(model, dev)
    weights = ((name, t if name in kept else materialize(t, torch_dtype))
               for name, t in ckpt.reader.weights(names))
    model.load_weights(weights, source=ckpt.reader.source)
    prepare_kernels(model)  # repacked weights and their calls' plans, before the first step
    trim_heap()  # what dequantizing and converting tensors allocated on the way
    model.eval()
    model.requires_grad_(False)
    model.init_rope(max_positions or cfg.max_position_embeddings)
    quantized, dense = weight_memory(model)
    logger.info("loaded %s from %s (%s): %d layers, hidden %d, %d/%d heads, dtype %s, device "
                "%s; weights %.1f MiB (quantized %.1f MiB: %s; dense %.1f MiB)",
                cfg.architecture, ckpt.path, ckpt.format, cfg.num_hidden_layers,
                cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, torch_dtype,
                dev, (quantized + dense) / 2**20, quantized / 2**20, describe(model),
                dense / 2**20)
    return model, cfg
