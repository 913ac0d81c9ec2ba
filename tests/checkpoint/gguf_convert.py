"""Test helper: write a transformers model as a GGUF file with `gguf`'s writer, laid out as
llama.cpp's convert_hf_to_gguf.py does (TensorNameMap names, q/k rows permuted for `llama`,
norms +1 for `gemma3`, 1-D tensors kept F32, Llama 3.1 RoPE as a `rope_freqs` tensor).

A quantized type changes the weights, so the model is changed in place to hold exactly what
the file encodes (each matrix becomes dequantize(file data)); a safetensors copy saved after
`to_gguf` therefore holds the same weights as the GGUF file. `gguf` quantizes the 32-block
types; for the k-quants (which it only dequantizes) the file gets random valid blocks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFWriter,
    RopeScalingType,
    get_tensor_name_map,
)
from gguf.quants import dequantize, quantize

Q = GGMLQuantizationType
# Byte offsets of the float16 scale fields in one block of each k-quant.
_K_SCALE_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                   Q.Q6_K: (208,)}
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
         "gemma3_text": "gemma3"}


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute on the first axis (works on rows of blocks too)."""
    n, tail = rows.shape[0], rows.shape[1:]
    return rows.reshape(heads, 2, n // heads // 2, *tail).swapaxes(1, 2).reshape(n, *tail)


def random_kquant(rows: int, cols: int, qtype: GGMLQuantizationType,
                  rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks whose dequantized values have a std of about cols ** -0.5."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)

    def set_scales(scale: float) -> None:
        for off in _K_SCALE_FIELDS[qtype]:
            values = (rng.uniform(0.5, 1.0, size=(rows, cols // block)) * scale)
            raw[:, :, off:off + 2] = values.astype(np.float16).view(np.uint8).reshape(
                rows, cols // block, 2)

    set_scales(1e-3)
    std = float(dequantize(raw.reshape(rows, -1), qtype).std())
    set_scales(1e-3 * cols ** -0.5 / std)
    return raw.reshape(rows, -1)


def encode(values: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator
           ) -> np.ndarray:
    """File data for a matrix: quantized by `gguf`, or random blocks for a k-quant."""
    if qtype in _K_SCALE_FIELDS:
        return random_kquant(values.shape[0], values.shape[1], qtype, rng)
    return quantize(values, qtype)


def to_gguf(hf: torch.nn.Module, path: Path, qtype: GGMLQuantizationType = Q.F32, *,
            tokenizer_dir: Path | None = None, seed: int = 0,
            types: dict[str, GGMLQuantizationType] | None = None,
            edit: Callable[[GGUFWriter], None] | None = None) -> None:
    """Write `hf` to `path`; matrices in `qtype` (or `types[gguf_name]`), 1-D tensors F32.
    `edit(writer)` may change the metadata (`writer.kv_data[0]`) and tensors
    (`writer.tensors[0]`) just before the file is written (tests of broken files)."""
    cfg = hf.config
    arch = _ARCH[cfg.model_type]
    rng = np.random.default_rng(seed)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny {cfg.model_type}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if arch == "gemma3":
        rope = dict(rope.get("full_attention", rope))
        writer.add_sliding_window(cfg.sliding_window)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 1e4))))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if head_dim != cfg.hidden_size // heads or arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if tokenizer_dir is not None:
        _add_tokenizer(writer, tokenizer_dir)

    name_map = get_tensor_name_map(next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch),
                                   cfg.num_hidden_layers)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    state = {k: v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.no_grad():
        for hf_name, tensor in state.items():
            base, _, suffix = hf_name.rpartition(".")
            gguf_name = f"{name_map.get_name(base)}.{suffix}"
            values = tensor.detach().float().numpy()
            kind = (types or {}).get(gguf_name, qtype) if values.ndim == 2 else Q.F32
            if values.shape[-1] % GGML_QUANT_SIZES[kind][0]:
                kind = Q.F16  # rows that are no whole number of blocks: llama.cpp falls back
            data = encode(values, kind, rng) if kind != Q.F32 else values.copy()
            # What the file holds, back in the model, so the reference equals the file.
            tensor.copy_(torch.from_numpy(dequantize(data, kind).reshape(values.shape).copy()))
            if arch == "llama" and ".q_proj." in hf_name:
                data = _permute(data, heads)
            elif arch == "llama" and ".k_proj." in hf_name:
                data = _permute(data, kv_heads)
            if arch == "gemma3" and hf_name.endswith("norm.weight"):
                data = data + np.float32(1.0)
            writer.add_tensor(gguf_name, np.ascontiguousarray(data),
                              raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
    if edit is not None:
        edit(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama3_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes for Llama 3.1 scaling."""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_tokenizer(writer: GGUFWriter, folder: Path) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's `gpt2` vocabulary."""
    data = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["content"]: t["id"] for t in data["added_tokens"] if t.get("special")}
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special[config["bos_token"]])
    writer.add_eos_token_id(special[config["eos_token"]])
    writer.add_pad_token_id(special[config["pad_token"]])
    writer.add_add_bos_token(True)
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])
