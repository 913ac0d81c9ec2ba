"""The model shape and settings slotserve needs, read from a Hugging Face checkpoint folder.

Only the Llama family is supported: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k
RMSNorm). They share one module tree (`models/llama.py`); this record carries the differences.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Configs without an `architectures` list still name their family in `model_type`.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(slots=True)
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


@dataclass(slots=True)
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
    sliding_window: int | None = None
    torch_dtype: str | None = None

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        if not folder.is_dir():
            raise ModelLoadError(f"model folder {str(folder)!r} does not exist")
        config_file = folder / "config.json"
        raw = _read_json(config_file, required=True)
        gen = _read_json(folder / "generation_config.json", required=False)
        return cls.from_dict(raw, generation_config=gen, source=str(config_file))

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
            cfg = cls(
                architecture=arch,
                model_type=str(raw.get("model_type", "")),
                hidden_size=hidden,
                num_hidden_layers=int(raw["num_hidden_layers"]),
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
                qk_norm=arch == "Qwen3ForCausalLM",
                eos_token_id=_eos_ids(raw, generation_config),
                bos_token_id=raw.get("bos_token_id"),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                sliding_window=_sliding_window(raw, arch),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
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
            return arch
    named = ", ".join(map(str, archs)) or f"model_type={raw.get('model_type')!r}"
    raise ModelLoadError(f"unsupported architecture {named} in {source}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes everything into `rope_parameters` (theta included); older configs
    # use `rope_theta` plus an optional `rope_scaling` dict. Read both; the nested dict wins.
    params: dict[str, Any] = {}
    if isinstance(raw.get("rope_scaling"), dict):
        params.update(raw["rope_scaling"])
    if isinstance(raw.get("rope_parameters"), dict):
        params.update(raw["rope_parameters"])
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
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
