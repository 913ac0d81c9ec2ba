"""Per-layer attention settings from configs: Gemma 3's layer pattern and two RoPE bases (as
transformers 5 writes them and in the older keys), the defaults when a checkpoint is silent,
other families' sliding windows, and the Gemma norm convention of the loaded parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from slotserve.errors import ModelLoadError
from slotserve.model_config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    gemma3_layer_types,
)
from slotserve.models.gemma3 import Gemma3ForCausalLM
from slotserve.models.loader import load_model
from slotserve.models.registry import MODEL_CLASSES
from tests.helpers import TinyModel

GEMMA: dict[str, Any] = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                             hidden_size=640, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=256, num_hidden_layers=18, intermediate_size=2048,
                             vocab_size=262144, sliding_window=512)
S, F = SLIDING_ATTENTION, FULL_ATTENTION


def test_gemma3_classic_keys() -> None:
    cfg = ModelConfig.from_dict({**GEMMA, "rope_theta": 500000.0, "rope_local_base_freq": 5000.0,
                                 "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                 "sliding_window_pattern": 3, "query_pre_attn_scalar": 168})
    assert cfg.layer_types == [S, S, F] * 6
    assert [cfg.layer_window(i) for i in range(3)] == [512, 512, None]
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (500000.0, "linear", 8.0)
    local = cfg.rope_local
    assert local is not None and (local.theta, local.rope_type) == (5000.0, "default")
    assert cfg.layer_rope(0) is local and cfg.layer_rope(2) is cfg.rope
    assert cfg.attention_scale == 168 ** -0.5
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"


def test_gemma3_rope_parameters_per_layer_type() -> None:
    cfg = ModelConfig.from_dict({**GEMMA, "rope_parameters": {
        FULL_ATTENTION: {"rope_type": "linear", "factor": 4.0, "rope_theta": 2e6},
        SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 2e4}}})
    assert (cfg.rope.theta, cfg.rope.factor) == (2e6, 4.0)
    assert cfg.rope_local is not None and cfg.rope_local.theta == 2e4


def test_gemma3_defaults_when_the_checkpoint_is_silent() -> None:
    """What a GGUF file omits: every 6th layer global (5, 11, 17), bases 1e6 / 1e4, scale 256."""
    cfg = ModelConfig.from_dict(GEMMA)
    assert [i for i, t in enumerate(cfg.layer_types) if t == F] == [5, 11, 17]
    assert cfg.layer_types == gemma3_layer_types(18)
    assert cfg.rope.theta == 1e6 and cfg.rope_local is not None and cfg.rope_local.theta == 1e4
    assert cfg.attention_scale == 256 ** -0.5 and cfg.final_logit_softcapping is None


def test_gemma3_layer_types_helper() -> None:
    assert gemma3_layer_types(4, 2) == [S, F, S, F]
    assert gemma3_layer_types(3, 1) == [F, F, F]
    with pytest.raises(ModelLoadError, match="sliding_window_pattern"):
        gemma3_layer_types(3, 0)


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=[S] * 17), "each of the 18 layers"),
    (dict(layer_types=["chunked_attention"] * 18), "chunked_attention"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="relu"), "relu"),
])
def test_gemma3_unsupported_settings(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict({**GEMMA, **change})


def test_other_families_sliding_windows() -> None:
    base: dict[str, Any] = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=4,
                                intermediate_size=128, vocab_size=100, sliding_window=32)
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"]})
    assert [mistral.layer_window(i) for i in range(4)] == [32] * 4
    qwen = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"],
                                  "use_sliding_window": True, "max_window_layers": 2})
    assert [qwen.layer_window(i) for i in range(4)] == [None, None, 32, 32]
    off = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"],
                                 "layer_types": [S] * 4})  # use_sliding_window unset
    assert [off.layer_window(i) for i in range(4)] == [None] * 4
    llama = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"],
                                   "sliding_window": None})
    assert llama.layer_types == [] and llama.layer_window(0) is None and llama.rope_local is None


def test_saved_gemma3_config_round_trip(tiny_models: dict[str, TinyModel]) -> None:
    cfg = ModelConfig.from_pretrained(tiny_models["gemma3"].path)
    hf = tiny_models["gemma3"].hf.config
    assert cfg.layer_types == hf.layer_types and cfg.sliding_window == hf.sliding_window == 6
    assert cfg.rope.rope_type == "linear" and cfg.rope.factor == 4.0
    assert cfg.rope_local is not None and cfg.rope_local.theta == 1e4
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_norms_hold_one_plus_w_in_float32(tiny_models: dict[str, TinyModel],
                                                 dtype: torch.dtype) -> None:
    model, _ = load_model(tiny_models["gemma3"].path, dtype=dtype)
    assert isinstance(model, Gemma3ForCausalLM)
    hf = dict(tiny_models["gemma3"].hf.named_parameters())
    norms = [n for n, _ in model.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 4 * 6 + 1  # 4 layers x (4 + q/k), the final norm
    for name, param in model.named_parameters():
        if name in norms:
            assert param.dtype == torch.float32
            assert torch.equal(param, 1.0 + hf[name].to(dtype).float()), name
        else:
            assert param.dtype == dtype, name


def test_every_supported_architecture_has_a_model_class() -> None:
    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
