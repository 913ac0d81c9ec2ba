"""llama.cpp's GGUF LoRA adapters (convert_lora_to_gguf.py's files), read into the same
AdapterSpec as a PEFT folder; no torch.

As llama.cpp's loader (src/llama-adapter.cpp) reads them: `general.type` = "adapter",
`adapter.type` = "lora", `general.architecture` the base's, `adapter.lora.alpha` (0: scale 1,
else alpha / rank), and `blk.{i}.{attn_q,...,ffn_down}.weight.lora_a` [r, in] / `.lora_b`
[out, r] (numpy order; GGUF lists the dimensions reversed). For `llama` the converter
permuted the rows of q and k for llama.cpp's rotation, B's rows with them; the worker undoes
that as the model loader does (checkpoint/gguf_layout.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from slotserve.lora.request import LoRAAdapterError
from slotserve.model_config import ModelConfig

GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
                "ffn_down": "down_proj"}
# The base's model_type -> the GGUF architecture llama.cpp's converter writes for it.
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
              "gemma3_text": "gemma3", "gemma3": "gemma3"}
_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)

# (layer, module) -> {"A"|"B": (tensor name, numpy shape)}
Halves = dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...]]]]


def _reader(path: Path, fail: Callable[[str], LoRAAdapterError]) -> GGUFReader:
    try:
        return GGUFReader(path)
    except OSError as exc:
        raise fail(f"cannot read it: {exc}") from exc
    except Exception as exc:  # the gguf package raises ValueError/IndexError/KeyError/...
        raise fail(f"cannot parse the GGUF header ({exc!r})") from exc


def _field(reader: GGUFReader, key: str) -> object:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf_halves(path: Path, cfg: ModelConfig, fail: Callable[[str], LoRAAdapterError]
                     ) -> tuple[float, Halves]:
    """The file's alpha and its LoRA tensors by module, checked as llama.cpp checks them."""
    reader = _reader(path, fail)
    if _field(reader, "general.type") != "adapter" or _field(reader, "adapter.type") != "lora":
        raise fail("general.type must be 'adapter' and adapter.type 'lora' (a GGUF LoRA)")
    arch, want = _field(reader, "general.architecture"), _GGUF_ARCH.get(cfg.model_type)
    if want is not None and arch != want:
        raise fail(f"general.architecture is {arch!r}; the base model is {want!r}")
    alpha = _field(reader, "adapter.lora.alpha")
    alpha = 0.0 if alpha is None else alpha
    if not isinstance(alpha, int | float):
        raise fail(f"adapter.lora.alpha must be a number, got {alpha!r}")
    halves: Halves = {}
    for t in reader.tensors:
        m = _KEY.match(t.name)
        if m is None or m.group(2) not in GGUF_MODULES:
            raise fail(f"unexpected tensor {t.name!r} (slotserve applies LoRA to "
                       f"{', '.join(GGUF_MODULES)})")
        if t.tensor_type not in _FLOAT_TYPES:
            raise fail(f"{t.name}: type {t.tensor_type.name}; F32 or F16 expected")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        halves.setdefault((int(m.group(1)), GGUF_MODULES[m.group(2)]), {})[
            m.group(3).upper()] = (t.name, shape)
    return float(alpha), halves


def read_gguf_weights(path: Path, cfg: ModelConfig, keys: list[tuple[str, str]]
                      ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(A, B) float32 for each (A name, B name), B's q/k rows back in the base's order."""
    from slotserve.checkpoint.gguf_file import GGUFTensor
    from slotserve.checkpoint.gguf_layout import undo_conversion

    reader = GGUFReader(path)
    arch = str(_field(reader, "general.architecture"))
    tensors = {t.name: t for t in reader.tensors}
    out = []
    for a_key, b_key in keys:
        a, b = tensors[a_key], tensors[b_key]
        a_shape = tuple(int(d) for d in reversed(a.shape.tolist()))
        b_shape = tuple(int(d) for d in reversed(b.shape.tolist()))
        module = GGUF_MODULES[b_key.split(".")[2]]
        b_data = undo_conversion(arch, cfg, f"model.layers.0.self_attn.{module}.weight",
                                 GGUFTensor(b_key, b.tensor_type, b_shape,
                                            np.asarray(b.data).reshape(b_shape))).data
        out.append((np.array(a.data, dtype=np.float32).reshape(a_shape),  # copies: the file
                    np.array(b_data, dtype=np.float32)))                 # is a read-only map
    return out
