"""Load a Hugging Face checkpoint folder (config.json + safetensors) into its model class.

No network and no transformers: the config is parsed by `ModelConfig`, the weights are read
with `safetensors` shard by shard and copied into a module built on the meta device (so no
memory is spent on random initialisation). Every failure is a `ModelLoadError` naming the file.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from slotserve.errors import ModelLoadError
from slotserve.models.config import ModelConfig
from slotserve.models.layers import DecoderForCausalLM
from slotserve.models.registry import model_class

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Checkpoint keys that hold no weights we need (older exports saved the RoPE buffer).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# HF name -> (our fused parameter, which slice). Slices are resolved per layer below.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


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


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read {str(index)!r}: {exc!r}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        single = folder / "model.safetensors"
        files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no model.safetensors (or {INDEX_FILE}) in {str(folder)!r}")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"missing weights file {str(f)!r} (listed in {INDEX_FILE})")
    return files


def _target(cfg: ModelConfig, params: dict[str, torch.Tensor], key: str
            ) -> tuple[str, int, int] | None:
    """The destination of checkpoint tensor `key`: (parameter name, row offset, rows) or None."""
    m = _LAYER_KEY.match(key)
    if m is not None:
        layer, sub, kind = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_hidden_layers:
            return None
        fused = _FUSED.get(sub)
        if fused is not None:
            name, part = fused
            if name == "self_attn.qkv_proj":
                q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
                offsets = [(0, q), (q, kv), (q + kv, kv)]
            else:
                offsets = [(0, cfg.intermediate_size), (cfg.intermediate_size,
                                                        cfg.intermediate_size)]
            key = f"model.layers.{layer}.{name}.{kind}"
            start, rows = offsets[part]
            return (key, start, rows) if key in params else None
    if key in params:
        return key, 0, params[key].shape[0]
    return None


def load_model(path: str | Path, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, max_positions: int | None = None,
               ) -> tuple[DecoderForCausalLM, ModelConfig]:
    folder = Path(path)
    cfg = ModelConfig.from_pretrained(folder)
    files = weight_files(folder)
    torch_dtype = parse_dtype(dtype)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    model.to_dtype(torch_dtype)
    model = model.to_empty(device=dev)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    filled: dict[str, int] = dict.fromkeys(params, 0)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if _IGNORED.match(key):
                        continue
                    _copy_tensor(model, params, key, f.get_tensor(key), filled, file)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"cannot read weights file {str(file)!r}: {exc}") from exc
    missing = [_checkpoint_names(n) for n, p in params.items() if filled[n] < p.shape[0]]
    if missing:
        raise ModelLoadError(f"weights missing from {str(folder)!r}: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.eval()
    model.requires_grad_(False)
    model.init_rope(max_positions or cfg.max_position_embeddings)
    logger.info("loaded %s from %s: %d layers, hidden %d, %d/%d heads, dtype %s, device %s",
                cfg.architecture, folder, cfg.num_hidden_layers, cfg.hidden_size,
                cfg.num_attention_heads, cfg.num_key_value_heads, torch_dtype, dev)
    return model, cfg


def _checkpoint_names(param: str) -> str:
    """Our parameter name as the checkpoint spells it (a fused one lists its parts)."""
    for fused in {ours for ours, _ in _FUSED.values()}:
        if f".{fused}." in param:
            prefix, kind = param.split(f".{fused}.")
            return "/".join(f"{prefix}.{hf}.{kind}" for hf, (ours, _) in _FUSED.items()
                            if ours == fused)
    return param


def _copy_tensor(model: DecoderForCausalLM, params: dict[str, torch.Tensor], key: str,
                 tensor: torch.Tensor, filled: dict[str, int], file: Path) -> None:
    cfg = model.config
    if key == "lm_head.weight" and cfg.tie_word_embeddings:
        return  # some tied checkpoints store both; the embedding is the one we use
    target = _target(cfg, params, key)
    if target is None:
        logger.debug("ignoring unexpected tensor %s in %s", key, file.name)
        return
    name, start, rows = target
    param = params[name]
    expected = (rows, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise ModelLoadError(f"tensor {key} in {str(file)!r} has shape {tuple(tensor.shape)}, "
                             f"expected {expected}")
    with torch.no_grad():
        param[start:start + rows].copy_(model.checkpoint_tensor(key, tensor))
    filled[name] += rows
