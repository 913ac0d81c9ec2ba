"""The model shape and settings slotserve needs, read from a Hugging Face checkpoint folder.

Supported: the Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with per-head q/k
RMSNorm; one module tree, `models/llama.py`) and Gemma 3 text (`models/gemma3.py`). This record
carries the differences, including which layers attend through a sliding window and the RoPE
of those layers when it differs (Gemma 3: local base 10,000, global 1,000,000).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

# Each supported architecture by its `model_type` (configs without an `architectures` list
# still name their family there).
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPE_TO_ARCH.values())
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# transformers' names for the attention of a layer (`layer_types`).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# Gemma 3 when the checkpoint is silent (transformers' and llama.cpp's defaults).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_THETA, GEMMA3_ROPE_LOCAL_THETA = 1_000_000.0, 10_000.0
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    # "default" (plain RoPE), "llama3" (Llama 3.1 frequency smoothing) or "linear".
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # Per-frequency divisors of the inverse frequencies: how llama.cpp stores Llama 3.1's
    # scaling in a GGUF file (its `rope_freqs` tensor) instead of the parameters above.
    freq_factors: list[float] | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    # Bias on q/k/v projections (Qwen2 always; Llama/Qwen3 when `attention_bias`).
    attention_bias: bool = False
    # Bias on o_proj (Llama/Qwen3 `attention_bias` covers o_proj too; Qwen2 never).
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # Qwen3: RMSNorm over each head of q and k before RoPE.
    qk_norm: bool = False
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    max_position_embeddings: int = 2048
    # Width of the sliding window of the layers whose `layer_types` entry says so.
    sliding_window: int | None = None
    # Per layer FULL_ATTENTION or SLIDING_ATTENTION; empty: every layer full.
    layer_types: list[str] = field(default_factory=list)
    # RoPE of the sliding-window layers when it differs from `rope` (Gemma 3's local base).
    rope_local: RopeConfig | None = None
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim.
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"  # the gate activation of the MLP
    final_logit_softcapping: float | None = None
    torch_dtype: str | None = None

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        # As transformers writes it (x ** -0.5 and 1 / sqrt(x) can differ in the last bit).
        return float(float(self.query_pre_attn_scalar or self.head_dim) ** -0.5)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None when it attends to the whole context."""
        if (self.sliding_window is None or not self.layer_types
                or self.layer_types[layer] != SLIDING_ATTENTION):
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.rope_local is not None and self.layer_window(layer) is not None:
            return self.rope_local
        return self.rope

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        if not folder.is_dir():
            raise ModelLoadError(f"model folder {str(folder)!r} does not exist")
        config_file = folder / "config.json"
        raw = _read_json(config_file, required=True)
        gen = _read_json(folder / "generation_config.json", required=False)
        return cls.from_dict(raw or {}, generation_config=gen, source=str(config_file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None,
                  source: str = "config") -> ModelConfig:
        arch = _architecture(raw, source)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            # Mistral writes "head_dim": null; Qwen3 sets a head_dim unrelated to hidden/heads.
            head_dim = int(raw.get("head_dim") or hidden // heads)
            attention_bias = bool(raw.get("attention_bias", False))
            qwen2 = arch == "Qwen2ForCausalLM"
            num_layers = int(raw["num_hidden_layers"])
            window = _sliding_window(raw, arch)
            cfg = cls(
                architecture=arch,
                model_type=str(raw.get("model_type", "")),
                hidden_size=hidden,
                num_hidden_layers=num_layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_rope(raw, source),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=True if qwen2 else attention_bias,
                o_proj_bias=False if qwen2 else attention_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
                qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
                eos_token_id=_eos_ids(raw, generation_config),
                bos_token_id=raw.get("bos_token_id"),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                sliding_window=window,
                layer_types=_layer_types(raw, arch, num_layers, window, source),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
            if arch == "Gemma3ForCausalLM":
                cfg = dataclasses.replace(cfg, **_gemma3(raw, source))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: bad or missing field ({exc!r})") from exc
        if heads % kv_heads != 0:
            raise ModelLoadError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                                 f"num_key_value_heads ({kv_heads})")
        return cfg


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"missing {path.name} in {str(path.parent)!r}")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(path)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{str(path)!r} does not hold a JSON object")
    return data


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in _MODEL_TYPE_TO_ARCH:
        archs = [_MODEL_TYPE_TO_ARCH[raw["model_type"]]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    named = ", ".join(map(str, archs)) or f"model_type={raw.get('model_type')!r}"
    raise ModelLoadError(f"unsupported architecture {named} in {source}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(raw: dict[str, Any], source: str, layer_type: str = FULL_ATTENTION,
          default_theta: float = 10000.0, theta_key: str = "rope_theta") -> RopeConfig:
    # transformers 5 writes everything into `rope_parameters` (theta included), one dict per
    # layer type where the types differ (Gemma 3); older configs use `rope_theta` (Gemma 3's
    # local layers: `rope_local_base_freq`) plus an optional `rope_scaling` dict, which
    # transformers applies to the full-attention layers only. Read both; the nested dict wins.
    params: dict[str, Any] = {}
    if isinstance(raw.get("rope_scaling"), dict) and layer_type == FULL_ATTENTION:
        params.update(raw["rope_scaling"])
    nested = raw.get("rope_parameters")
    if isinstance(nested, dict) and (FULL_ATTENTION in nested or SLIDING_ATTENTION in nested):
        nested = nested.get(layer_type)
    if isinstance(nested, dict):
        params.update(nested)
    theta = params.get("rope_theta", raw.get(theta_key, default_theta))
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope_type {rope_type!r}; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    orig = params.get("original_max_position_embeddings")
    factors = raw.get("rope_freq_factors")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
        freq_factors=[float(f) for f in factors] if factors is not None else None,
    )


def gemma3_layer_types(num_layers: int,
                       sliding_window_pattern: int = GEMMA3_SLIDING_WINDOW_PATTERN) -> list[str]:
    """Gemma 3's layer pattern when a checkpoint does not list it: every
    `sliding_window_pattern`-th layer (5, 11, 17, ... by default) is global, the rest local."""
    if sliding_window_pattern < 1:
        raise ModelLoadError(f"sliding_window_pattern must be >= 1, got {sliding_window_pattern}")
    return [SLIDING_ATTENTION if (i + 1) % sliding_window_pattern else FULL_ATTENTION
            for i in range(num_layers)]


def _layer_types(raw: dict[str, Any], arch: str, num_layers: int, window: int | None,
                 source: str) -> list[str]:
    explicit = raw.get("layer_types")
    if explicit is not None:
        types = [str(t) for t in explicit]
        unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if len(types) != num_layers or unknown:
            raise ModelLoadError(f"{source}: layer_types must list {FULL_ATTENTION!r} or "
                                 f"{SLIDING_ATTENTION!r} for each of the {num_layers} layers"
                                 + (f" (unsupported: {', '.join(unknown)})" if unknown else ""))
        return types
    if window is None:
        return []
    if arch == "Gemma3ForCausalLM":
        # Hub configs spell it `sliding_window_pattern`; transformers 5 saves `_sliding_...`.
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
        return gemma3_layer_types(num_layers, int(pattern or GEMMA3_SLIDING_WINDOW_PATTERN))
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # transformers: the layers from max_window_layers on use the window.
        first = int(raw.get("max_window_layers", num_layers))
        return [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
    return [SLIDING_ATTENTION] * num_layers  # Mistral: every layer


def _gemma3(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 3 text: two RoPE bases, a query scale of its own, GeGLU, tied embeddings."""
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(key):
            raise ModelLoadError(f"{source}: unsupported Gemma 3 setting {key}={raw[key]!r}")
    hidden_act = str(raw.get("hidden_activation") or raw.get("hidden_act")
                     or "gelu_pytorch_tanh")
    if hidden_act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{source}: unsupported Gemma 3 activation {hidden_act!r}")
    softcap = raw.get("final_logit_softcapping")
    return {"rope": _rope(raw, source, FULL_ATTENTION, GEMMA3_ROPE_THETA),
            "rope_local": _rope(raw, source, SLIDING_ATTENTION, GEMMA3_ROPE_LOCAL_THETA,
                                theta_key="rope_local_base_freq"),
            "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar")
                                           or GEMMA3_QUERY_PRE_ATTN_SCALAR),
            "hidden_act": hidden_act,
            "final_logit_softcapping": float(softcap) if softcap is not None else None,
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))}


def _eos_ids(raw: dict[str, Any], gen: dict[str, Any] | None) -> list[int]:
    # generation_config.json is what `generate` honours, so it takes precedence.
    for source in (gen or {}, raw):
        eos = source.get("eos_token_id")
        if eos is None:
            continue
        ids = [eos] if isinstance(eos, int) else list(eos)
        return [int(t) for t in ids]
    return []


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    # Qwen2/Qwen3 carry a window they only use when `use_sliding_window` is set.
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window"):
        return None
    return int(window)
