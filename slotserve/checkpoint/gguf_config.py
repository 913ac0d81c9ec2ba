"""GGUF metadata -> a Hugging Face style config dict (what config.json would hold), which
`ModelConfig.from_dict` then reads like any checkpoint's.

Key names are llama.cpp's (`{arch}.embedding_length`, ...). Where the file is silent, the
values are the ones llama.cpp and transformers assume for the architecture (each noted below).
The result is cached with the file's index: changing it means bumping cache.CACHE_FORMAT.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from gguf import GGUFReader

from slotserve.checkpoint.gguf_checks import check_config, check_positive, check_vocabulary
from slotserve.checkpoint.gguf_file import GGUFTensorInfo, token_ids_of
from slotserve.errors import ModelLoadError

# general.architecture -> the Hugging Face architecture slotserve runs it as.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Llama and Mistral-style models
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Tokens llama.cpp ends generation on besides the file's EOS (its vocabulary loader treats
# these as end-of-generation when it finds them): chat turn ends of the common templates.
END_OF_TURN_TOKENS = frozenset({"<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|eom_id|>",
                                "<|end|>", "<|endoftext|>", "<EOT>"})
_CONTROL = 3  # llama.cpp token type CONTROL
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
             "tokenizer.ggml.eom_token_id")


class _Keys:
    """Reads `{arch}.{name}`, naming the missing or malformed key in the error."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, source: str) -> None:
        self.metadata, self.arch, self.source = metadata, arch, source

    def get(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{name}", default)

    def int(self, name: str, default: int | None = None) -> int:
        value = self.get(name, default)
        if value is None:
            raise ModelLoadError(f"{self.source}: GGUF metadata key {self.arch}.{name} is missing")
        if not isinstance(value, int):
            raise ModelLoadError(f"{self.source}: GGUF metadata key {self.arch}.{name} is "
                                 f"{value!r}, expected one integer")
        return value

    def number(self, name: str, default: float) -> float:
        value = self.get(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ModelLoadError(f"{self.source}: GGUF metadata key {self.arch}.{name} is "
                                 f"{value!r}, expected one number")
        return float(value)


def derive_config(metadata: Mapping[str, Any], tensors: Mapping[str, GGUFTensorInfo],
                  reader: GGUFReader, source: str) -> dict[str, Any]:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r} (GGUF key "
                             f"general.architecture); supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)}")
    keys = _Keys(metadata, str(arch), source)
    hidden = keys.int("embedding_length")
    heads = keys.int("attention.head_count")
    check_positive(source, f"{arch}.embedding_length", hidden)
    check_positive(source, f"{arch}.attention.head_count", heads)
    head_dim = keys.int("attention.key_length", hidden // heads)
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{source}: tensor token_embd.weight is missing")
    special_ids = {key: metadata.get(key) for key in (
        "tokenizer.ggml.bos_token_id", *_EOS_KEYS)}
    check_vocabulary(metadata, reader, embed.shape[0], special_ids, source)
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": keys.int("block_count"),
        "intermediate_size": keys.int("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": keys.int("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": keys.number("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": keys.number("rope.freq_base", 10000.0),
        "max_position_embeddings": keys.int("context_length", 2048),
        # The embedding's rows, not the token list: some converters pad one or the other.
        "vocab_size": embed.shape[0],
        # llama.cpp writes the output projection only when it is not the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(metadata, reader),
    }
    check_config(config, metadata, tensors, source)
    rope_dims = keys.get("rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise ModelLoadError(f"{source}: {arch}.rope.dimension_count={rope_dims} rotates only "
                             f"part of each {head_dim}-dim head, which slotserve does not support")
    config.update(_rope_scaling(keys, reader, tensors, head_dim, source))
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    elif arch == "gemma3":
        config.update(_gemma3(keys))
    return config


def _rope_scaling(keys: _Keys, reader: GGUFReader, tensors: Mapping[str, GGUFTensorInfo],
                  head_dim: int, source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kind = keys.get("rope.scaling.type", "none")
    if kind == "linear":
        out["rope_scaling"] = {"rope_type": "linear",
                               "factor": keys.number("rope.scaling.factor", 1.0)}
    elif kind != "none":
        raise ModelLoadError(f"{source}: unsupported RoPE scaling {kind!r} (GGUF key "
                             f"{keys.arch}.rope.scaling.type); supported: none, linear")
    if "rope_freqs.weight" in tensors:  # Llama 3.1's scaling, stored as per-frequency factors
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        values = np.asarray(factors.data, dtype=np.float32).reshape(-1)
        if values.shape[0] != head_dim // 2:
            raise ModelLoadError(f"{source}: tensor rope_freqs.weight has {values.shape[0]} "
                                 f"values, expected {head_dim // 2}")
        out["rope_freq_factors"] = values.tolist()
    return out


def _gemma3(keys: _Keys) -> dict[str, Any]:
    """Gemma 3: what the file states beyond the common keys. It omits the layer pattern, the
    local RoPE base and the query scale: `ModelConfig` fills in transformers' defaults for a
    Gemma 3 config that omits them (every 6th layer global, 10,000, 256), which are also
    llama.cpp's for every released size but 27B."""
    return {
        "model_type": "gemma3_text",
        "sliding_window": keys.int("attention.sliding_window", 512),
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": keys.get("final_logit_softcapping"),
        "attn_logit_softcapping": keys.get("attn_logit_softcapping"),
    }


def _eos_ids(metadata: Mapping[str, Any], reader: GGUFReader) -> list[int]:
    ids: list[int] = []
    for key in _EOS_KEYS:
        value = metadata.get(key)
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    types = reader.fields.get("tokenizer.ggml.token_type")
    for token_id in sorted(token_ids_of(reader, set(END_OF_TURN_TOKENS)).values()):
        is_control = (types is None or token_id >= len(types.data)
                      or types.parts[types.data[token_id]][0] == _CONTROL)
        if is_control and token_id not in ids:
            ids.append(token_id)
    return ids
