"""How llama.cpp's converter (convert_hf_to_gguf.py) laid a Hugging Face checkpoint out in a
GGUF file, and how to undo it, so the GGUF reader delivers tensors exactly as the safetensors
reader would.

- Names: `gguf`'s own TensorNameMap (the table the converter uses) maps each Hugging Face
  tensor name the model asks for to its GGUF name (`model.layers.3.mlp.up_proj.weight` ->
  `blk.3.ffn_up.weight`).
- `llama`: the converter permutes the rows of q and k (weights and biases) so llama.cpp can
  rotate adjacent pairs (`LlamaModel.permute`: heads x (2, d/2) -> heads x (d/2, 2)); the
  inverse is applied here. It only moves whole rows, so it works on quantized rows as well.
  qwen2/qwen3 rotate halves in llama.cpp too (NEOX style) and are stored unpermuted.
- `gemma3`: every `*norm.weight` is stored with the 1 of Gemma's `x * (1 + w)` added; it is
  subtracted again (norms are F32 in every file llama.cpp writes).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
from gguf.quants import dequantize

from slotserve.checkpoint.gguf_file import GGUFTensor
from slotserve.model_config import ModelConfig

_NORM_SHIFT = {"gemma3": 1.0}
_PERMUTED_QK = {"llama"}


def gguf_names(arch: str, num_layers: int, hf_names: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for the Hugging Face names given."""
    arch_id = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch)
    name_map = get_tensor_name_map(arch_id, num_layers)
    out: dict[str, str] = {}
    for hf in hf_names:
        base, _, suffix = hf.rpartition(".")
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            out[f"{gguf_base}.{suffix}"] = hf
    return out


def _unpermute_rows(data: np.ndarray, heads: int) -> np.ndarray:
    rows = data.shape[0]
    tail = data.shape[1:]
    return np.ascontiguousarray(
        data.reshape(heads, rows // heads // 2, 2, *tail).swapaxes(1, 2).reshape(rows, *tail))


def undo_conversion(arch: str, cfg: ModelConfig, hf_name: str, t: GGUFTensor) -> GGUFTensor:
    """The tensor as the Hugging Face checkpoint holds it (still in its GGUF type, except a
    shifted norm, which comes back as F32)."""
    if arch in _PERMUTED_QK:
        if ".q_proj." in hf_name:
            t = GGUFTensor(t.name, t.ggml_type, t.shape,
                           _unpermute_rows(t.data, cfg.num_attention_heads))
        elif ".k_proj." in hf_name:
            t = GGUFTensor(t.name, t.ggml_type, t.shape,
                           _unpermute_rows(t.data, cfg.num_key_value_heads))
    shift = _NORM_SHIFT.get(arch)
    if shift is not None and t.name.endswith("norm.weight"):
        values = dequantize(t.data, t.ggml_type).reshape(t.shape)
        t = GGUFTensor(t.name, GGMLQuantizationType.F32, t.shape,
                       (values - np.float32(shift)).astype(np.float32))
    return t
