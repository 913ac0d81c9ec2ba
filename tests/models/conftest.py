"""Tiny random-weight Hugging Face checkpoints of every supported architecture.

Each is built with transformers' own config class, given weights with enough spread that
greedy decoding has no near-ties, and saved with `save_pretrained`; tests compare slotserve's
runner with the in-memory HF model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 384
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, max_position_embeddings=512,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (config class, model class, extra config kwargs)
TINY_MODELS: dict[str, tuple[type, type, dict[str, Any]]] = {
    # GQA, untied, Llama 3.1 rope scaling written the classic way (transformers 5 moves it
    # into rope_parameters on save, so both spellings are exercised by the config tests).
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # MHA, tied embeddings.
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    # head_dim from config (32) unrelated to hidden / heads (16), GQA 4:1.
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
        sliding_window=None)),
    # qkv bias, tied.
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=1000000.0)),
    # per-head q/k RMSNorm, head_dim 32, untied.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    # Gemma 3: local layers with a 6-token window (not a multiple of the tests' block sizes,
    # so windows start mid-block; prompts run far past it) around one global layer, each kind
    # with its own RoPE (linear scaling on the global one, as the 4B+ models have), one KV
    # head, head_dim 32 != hidden / heads, a query scale that is not head_dim, tied.
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=6, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


@dataclass
class TinyModel:
    name: str
    path: Path
    hf: torch.nn.Module


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with a spread large enough that logits are far from ties (std 0.02 is not).

    Gemma multiplies the embedding by sqrt(hidden) and ties the LM head, so with the same
    spread the input token's own embedding dominates the residual stream and greedy decoding
    just repeats it: its embeddings are smaller and its norms (which scale by 1 + w) stronger.
    """
    gemma = getattr(getattr(model, "config", None), "model_type", "") == "gemma3_text"
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_((3.0 if gemma else 1.0) + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.25 * noise if gemma else noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def build_tiny(name: str, folder: Path, seed: int = 0, **overrides: Any) -> TinyModel:
    config_cls, model_cls, extra = TINY_MODELS[name]
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    hf = model_cls(config).eval()
    randomize(hf, seed)
    hf.save_pretrained(folder)
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return TinyModel(name, folder, hf)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: build_tiny(name, root / name, seed=i)
            for i, name in enumerate(TINY_MODELS)}


@pytest.fixture(params=list(TINY_MODELS))
def tiny_model(request: pytest.FixtureRequest, tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models[request.param]
