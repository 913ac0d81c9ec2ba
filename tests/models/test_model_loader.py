"""Config parsing and checkpoint loading, including every way a checkpoint can be broken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from slotserve.errors import ModelLoadError
from slotserve.model_config import ModelConfig
from slotserve.models.loader import load_model
from tests.helpers import TinyModel, build_tiny

BASE = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4,
            num_hidden_layers=2, intermediate_size=128, vocab_size=100)


def test_config_reads_classic_rope_keys() -> None:
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert cfg.rope.theta == 500000.0 and cfg.rope.rope_type == "llama3"
    assert cfg.rope.factor == 32.0 and cfg.rope.original_max_position_embeddings == 8192
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16


def test_config_reads_rope_parameters() -> None:
    cfg = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_theta": 1e6,
                                                             "rope_type": "default"}})
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "default"


def test_config_head_dim_eos_and_family_switches() -> None:
    cfg = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32,
                                 "num_key_value_heads": 2, "eos_token_id": [5, 6]},
                                generation_config={"eos_token_id": 7})
    assert cfg.head_dim == 32 and cfg.qk_norm and cfg.num_kv_groups == 2
    assert cfg.eos_token_id == [7]  # generation_config.json wins
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"],
                                     "head_dim": None, "eos_token_id": 2})
    assert mistral.head_dim == 16 and mistral.eos_token_id == [2]


def test_unsupported_rope_type() -> None:
    with pytest.raises(ModelLoadError, match="rope_type 'yarn'"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_saved_config_round_trip(tiny_models: dict[str, TinyModel]) -> None:
    for name, model in tiny_models.items():
        cfg = ModelConfig.from_pretrained(model.path)
        hf = model.hf.config
        assert cfg.num_key_value_heads == hf.num_key_value_heads, name
        assert cfg.head_dim == (getattr(hf, "head_dim", None)
                                or hf.hidden_size // hf.num_attention_heads), name
        assert cfg.tie_word_embeddings == hf.tie_word_embeddings, name
        assert cfg.eos_token_id == [2], name
    assert ModelConfig.from_pretrained(tiny_models["llama"].path).rope.rope_type == "llama3"


def test_loaded_weights_equal_hf(tiny_models: dict[str, TinyModel]) -> None:
    model, cfg = load_model(tiny_models["qwen2"].path)
    hf = dict(tiny_models["qwen2"].hf.named_parameters())
    attn = model.model.layers[1].self_attn
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    assert torch.equal(attn.qkv_proj.weight[:q], hf["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(attn.qkv_proj.bias[q + kv:], hf["model.layers.1.self_attn.v_proj.bias"])
    assert cfg.tie_word_embeddings and model.output_weight is model.model.embed_tokens.weight


def test_bfloat16_load(tiny_models: dict[str, TinyModel]) -> None:
    model, _ = load_model(tiny_models["llama"].path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.rope_cos.dtype == torch.bfloat16


def test_sharded_checkpoint(tmp_path: Path, tiny_models: dict[str, TinyModel]) -> None:
    hf = tiny_models["qwen3"].hf
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = load_model(tmp_path)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    # A shard named by the index but missing is named in the error.
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(tmp_path)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_missing_weights_file(tmp_path: Path, tiny_models: dict[str, TinyModel]) -> None:
    shutil.copy(tiny_models["llama"].path / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(tmp_path)


def test_corrupt_safetensors(tmp_path: Path, tiny_models: dict[str, TinyModel]) -> None:
    src = tiny_models["llama"].path
    shutil.copy(src / "config.json", tmp_path / "config.json")
    data = (src / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(tmp_path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    model = build_tiny("llama", tmp_path / "m")
    from safetensors.torch import load_file, save_file
    path = model.path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model.path)
