"""Tiny random-weight GGUF files, written here with `gguf`'s writer the way llama.cpp's converter
lays models out, load into exactly the weights the same model loads from safetensors, and
generate transformers' greedy tokens. One file per architecture, one per tensor type."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from slotserve.checkpoint import resolve_checkpoint
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.models.loader import load_model
from slotserve.models.quantization import dense_parameters
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.checkpoint.gguf_convert import Q, to_gguf
from tests.helpers import TINY_MODELS, ManualScheduler, build_tiny, hf_greedy, randomize

NEW_TOKENS = 16
PROMPTS = [[5, 9, 20, 7], list(range(10, 41)), [100, 3, 3, 250, 17, 60, 61]]
# Every type slotserve loads; the k-quants need rows of 256 values.
# A GGUF file carries no layer pattern or attention scale for Gemma 3: transformers assumes
# every 6th layer global and query_pre_attn_scalar 256, so the tiny Gemma written to GGUF
# takes those.
GGUF_OVERRIDES: dict[str, dict[str, object]] = {"gemma3": dict(
    num_hidden_layers=6, query_pre_attn_scalar=256,
    layer_types=["sliding_attention"] * 5 + ["full_attention"])}
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K,
         Q.Q5_K, Q.Q6_K]


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Same values; a weight kept quantized (the default, `auto`) is compared as the native
    kernel dequantizes it, which must be bit for bit gguf's own dequantizer."""
    pa, pb = dense_parameters(a), dense_parameters(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def greedy(path: Path, prompts: list[list[int]], chunk: int | None = None) -> list[list[int]]:
    """Greedy tokens with the file's blocks multiplied by float32 activations (`exact`: the
    same numbers as transformers' dequantized model up to the order of sums; the default
    int8 activations are held to a tolerance in tests/models/test_quantized_model.py)."""
    runner = ModelRunner(path, SchedulerConfig(max_num_seqs=4, max_model_len=128),
                         CacheConfig(block_size=4, num_blocks=256), dtype="float32",
                         device="cpu", quantization="exact")
    sched = ManualScheduler(block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, params, max_tokens=NEW_TOKENS)
    sched.run(runner, chunk=chunk)
    return [sched.requests[f"r{i}"].outputs for i in range(len(prompts))]


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_architecture_matches_safetensors_and_hf(tmp_path: Path, name: str) -> None:
    qtype = Q.Q8_0  # quantized, so the llama q/k permutation is undone on rows of blocks
    model = build_tiny(name, tmp_path / "hf", **GGUF_OVERRIDES.get(name, {}))
    to_gguf(model.hf, tmp_path / "m.gguf", qtype)
    model.hf.save_pretrained(tmp_path / "ref")  # now holds exactly what the file encodes
    ckpt = resolve_checkpoint(tmp_path / "m.gguf")
    assert ckpt.format == "gguf"
    assert ckpt.config.tie_word_embeddings == model.hf.config.tie_word_embeddings
    assert ckpt.config.head_dim == resolve_checkpoint(tmp_path / "ref").config.head_dim
    gguf_model, _ = load_model(tmp_path / "m.gguf")
    ref_model, _ = load_model(tmp_path / "ref")
    assert_same_weights(gguf_model, ref_model)
    refs = [hf_greedy(model.hf, p, NEW_TOKENS)[0] for p in PROMPTS]
    assert greedy(tmp_path / "m.gguf", PROMPTS, chunk=5) == refs


def _k_model(arch: str) -> torch.nn.Module:
    """Rows of 256 values (hidden 256, intermediate 512) so every k-quant fits."""
    common = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        hf = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:
        hf = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=64, tie_word_embeddings=True))
    randomize(hf.eval(), seed=3)
    return hf


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tensor_type_matches_safetensors(tmp_path: Path, qtype: Q, arch: str) -> None:
    hf = _k_model(arch)
    to_gguf(hf, tmp_path / "m.gguf", qtype, seed=1)
    hf.save_pretrained(tmp_path / "ref")
    gguf_model, cfg = load_model(tmp_path / "m.gguf")
    ref_model, _ = load_model(tmp_path / "ref")
    assert_same_weights(gguf_model, ref_model)
    if qtype in (Q.F32, Q.Q8_0, Q.Q4_K, Q.Q6_K):  # the Gemma file's types: whole generations
        hf.generation_config.eos_token_id = None
        refs = [hf_greedy(hf, p, NEW_TOKENS)[0] for p in PROMPTS]
        assert greedy(tmp_path / "m.gguf", PROMPTS) == refs


def test_mixed_types_like_a_real_file(tmp_path: Path) -> None:
    """Q4_K_M files mix types tensor by tensor (the Gemma file: Q8_0 embedding, Q5_0 q/k/gate/
    up, Q8_0 v, Q4_K output projection, Q6_K down)."""
    hf = _k_model("llama")
    types = {}
    for layer in range(2):
        types.update({f"blk.{layer}.attn_q.weight": Q.Q5_0, f"blk.{layer}.attn_k.weight": Q.Q5_0,
                      f"blk.{layer}.attn_v.weight": Q.Q8_0,
                      f"blk.{layer}.attn_output.weight": Q.Q4_K,
                      f"blk.{layer}.ffn_gate.weight": Q.Q5_0, f"blk.{layer}.ffn_up.weight": Q.Q5_0,
                      f"blk.{layer}.ffn_down.weight": Q.Q6_K})
    to_gguf(hf, tmp_path / "m.gguf", Q.Q8_0, types=types)
    hf.save_pretrained(tmp_path / "ref")
    assert_same_weights(load_model(tmp_path / "m.gguf")[0], load_model(tmp_path / "ref")[0])


def test_bfloat16_compute_dtype(tmp_path: Path) -> None:
    model = build_tiny("qwen2", tmp_path / "hf")
    to_gguf(model.hf, tmp_path / "m.gguf", Q.Q5_0)
    model.hf.save_pretrained(tmp_path / "ref")
    a, _ = load_model(tmp_path / "m.gguf", dtype="bfloat16")
    b, _ = load_model(tmp_path / "ref", dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    assert_same_weights(a, b)


def test_folder_holding_one_gguf(tmp_path: Path) -> None:
    model = build_tiny("llama_tied", tmp_path / "hf")
    (tmp_path / "dir").mkdir()
    to_gguf(model.hf, tmp_path / "dir" / "model.gguf", Q.F16)
    ckpt = resolve_checkpoint(tmp_path / "dir")
    assert ckpt.format == "gguf" and ckpt.path == tmp_path / "dir" / "model.gguf"
