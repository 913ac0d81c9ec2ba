"""`--quantization auto|exact|none` on GGUF files: which layers stay quantized, that they hold
exactly the values `none` holds, that the model's outputs agree (`exact` within float32
rounding, `auto`'s 8-bit activations within what that quantization costs), and what memory is
reported.

A tiny Llama with rows of 256 values (so every k-quant fits) is written to GGUF with types
mixed tensor by tensor as in a Q4_K_M file, plus one tensor in a type without a kernel (Q2_K)
and one in F16: those two must be dequantized at load while the rest stays in blocks.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.engine.args import EngineArgs
from slotserve.entrypoints.cli import build_parser, engine_kwargs_from_args
from slotserve.errors import ConfigError
from slotserve.models import native_build
from slotserve.models.loader import load_model
from slotserve.models.quantization import (
    QuantizedEmbedding,
    QuantizedLinear,
    dense_parameters,
    quantized_names,
)
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.checkpoint.gguf_convert import Q, to_gguf
from tests.helpers import ManualScheduler, randomize

LAYER_TYPES = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K,
               "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_0, "ffn_down": Q.Q6_K}


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler: nothing stays quantized")
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))
    randomize(hf.eval(), seed=3)
    types = {f"blk.{i}.{name}.weight": t for i in range(2) for name, t in LAYER_TYPES.items()}
    types["blk.1.ffn_down.weight"] = Q.Q2_K  # no kernel: dequantized at load
    types["output.weight"] = Q.F16  # not a block type
    path = tmp_path_factory.mktemp("mixed") / "m.gguf"
    to_gguf(hf, path, Q.Q8_0, types=types)  # the token embedding: Q8_0
    return path


def test_auto_keeps_what_a_kernel_runs_and_none_keeps_nothing(mixed_file: Path) -> None:
    auto, _ = load_model(mixed_file)
    assert sorted(quantized_names(auto)) == sorted(
        ["model.embed_tokens"]
        + [f"model.layers.{i}.{m}" for i in range(2)
           for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj")]
        + ["model.layers.0.mlp.down_proj"])
    assert isinstance(auto.model.layers[1].mlp.down_proj, nn.Linear)  # Q2_K
    assert isinstance(auto.lm_head, nn.Linear)  # F16
    qkv = auto.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear)
    # q and k (Q5_0) share one buffer and one kernel call, v (Q8_0) has its own.
    assert [(s.rows, s.qtype) for s in qkv.segments] == [(256 + 128, int(Q.Q5_0)),
                                                         (128, int(Q.Q8_0))]
    gate_up = auto.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, QuantizedLinear) and len(gate_up.segments) == 1
    assert isinstance(auto.model.embed_tokens, QuantizedEmbedding)

    none, _ = load_model(mixed_file, quantization="none")
    assert not quantized_names(none)
    a, b = dense_parameters(auto), dense_parameters(none)
    assert a.keys() == b.keys()
    for name in a:  # the kernel's dequantized values are gguf's, bit for bit
        assert torch.equal(a[name], b[name]), name


def _file_maps(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps `path`."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = line.split()[0].split("-")
            out.append((int(start, 16), int(end, 16)))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_single_tensor_blocks_are_the_files_map(mixed_file: Path) -> None:
    """A block buffer that is one checkpoint tensor is a view of the file's map (no copy:
    as with llama.cpp's mmap); a buffer fused from several tensors is its own memory. With
    `exact` nothing is repacked, so every single-tensor buffer stays the map's."""
    model, _ = load_model(mixed_file, quantization="exact")
    maps = _file_maps(mixed_file)

    def in_file(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in maps)

    layer = model.model.layers[0]
    assert in_file(model.model.embed_tokens.qweight)
    assert in_file(layer.self_attn.o_proj.qweight_0)
    assert in_file(layer.self_attn.qkv_proj.qweight_1)  # v alone in its buffer
    assert not in_file(layer.self_attn.qkv_proj.qweight_0)  # q and k, fused
    assert not in_file(layer.mlp.gate_up_proj.qweight_0)
    # The mapped blocks hold exactly the file's bytes: what `none` dequantizes, bit for bit
    # (checked above for every layer); here the lookups through the map agree too.
    none, _ = load_model(mixed_file, quantization="none")
    ids = torch.arange(0, 384, 7)
    assert torch.equal(model.model.embed_tokens(ids), none.model.embed_tokens(ids))
    # `auto` repacks at load (prepare_kernels), before any call: a buffer the kernel
    # multiplies interleaved (QuantWeight.repacked; AVX-512 VNNI builds) is then its packed
    # copy instead of the map's pages, and one it does not stays the map's.
    auto, _ = load_model(mixed_file)
    maps = _file_maps(mixed_file)  # this load mapped the file again, elsewhere
    for module in (auto.model.embed_tokens, auto.model.layers[0].self_attn.o_proj,
                   auto.model.layers[0].self_attn.qkv_proj):
        assert module._views is not None and module._plan is not None, "prepared at load"
        for name, view in zip(module._buffer_names(), module._views, strict=True):
            fused = module is auto.model.layers[0].self_attn.qkv_proj and name == "qweight_0"
            assert in_file(getattr(module, name)) == (not view.packed and not fused)
    assert torch.equal(auto.model.embed_tokens(ids), none.model.embed_tokens(ids))


def run(path: Path, quantization: str, prompts: list[list[int]]) -> ManualScheduler:
    runner = ModelRunner(path, SchedulerConfig(max_num_seqs=4, max_model_len=128),
                         CacheConfig(block_size=4, num_blocks=256), dtype="float32",
                         device="cpu", quantization=quantization)
    sched = ManualScheduler(block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, params, max_tokens=12)
    sched.run(runner, chunk=5)
    return sched


@pytest.mark.parametrize("mode,tolerance", [("exact", 1e-4), ("auto", 1.0)])
def test_quantized_generates_what_none_generates(mixed_file: Path, mode: str,
                                                 tolerance: float) -> None:
    """Batched, chunked prefill and decodes against the dequantized model. `exact`: the same
    greedy tokens and top-5 logprobs within float32 rounding. `auto` (8-bit activations): the
    same tokens until a step whose top two the reference itself has within `tolerance` (a
    near tie; this tiny random model has flat distributions), and until then the logprobs of
    the tokens both top 5s hold within `tolerance` (measured 0.65: the random weights make
    logits with a std of 17, so the ~1% relative error of 8-bit activations moves them by
    tenths; the real model's bound is tests/checkpoint/test_gemma_quantized.py's)."""
    prompts = [[5, 9, 20, 7], list(range(10, 41)), [100, 3, 3, 250, 17, 60, 61]]
    auto, none = run(mixed_file, mode, prompts), run(mixed_file, "none", prompts)
    worst = 0.0
    for rid, ref in none.requests.items():
        got = auto.requests[rid]
        if mode == "exact":
            assert got.outputs == ref.outputs, rid
        for step, (mine, theirs) in enumerate(zip(got.logprobs, ref.logprobs, strict=True)):
            if mode == "exact":
                assert mine.keys() == theirs.keys()
            common = mine.keys() & theirs.keys()  # int8 may reorder the bottom of the top 5
            worst = max(worst, max(abs(mine[t] - theirs[t]) for t in common))
            if got.outputs[step] != ref.outputs[step]:
                gap = theirs[ref.outputs[step]] - theirs.get(got.outputs[step], -math.inf)
                assert gap < tolerance, f"{rid} step {step}: not a near tie ({gap:.3g})"
                break
    print(f"{mode}: worst top-5 logprob difference {worst:.3g}")
    assert worst < tolerance, worst


def test_reported_memory(mixed_file: Path) -> None:
    def runner(q: str) -> ModelRunner:
        return ModelRunner(mixed_file, SchedulerConfig(max_num_seqs=2, max_model_len=64),
                           CacheConfig(block_size=4, num_blocks=33), dtype="float32",
                           device="cpu", quantization=q)

    auto, none = runner("auto"), runner("none")
    assert 0 < auto.memory.quantized_weights_bytes < auto.memory.weights_bytes
    assert none.memory.quantized_weights_bytes == 0
    assert auto.memory.weights_bytes < none.memory.weights_bytes / 2
    # 2 layers x (K and V) x 33 blocks x 4 tokens x 2 KV heads x 64 dims x 4 bytes
    assert auto.memory.kv_cache_bytes == 2 * 2 * 33 * 4 * 2 * 64 * 4


def test_where_no_kernel_runs_auto_dequantizes(mixed_file: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="slotserve.models.quantization"):
        model, _ = load_model(mixed_file, dtype="bfloat16")
    assert not quantized_names(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert any("float32 activations" in r.getMessage() for r in caplog.records)


def test_the_setting_is_checked_and_reaches_the_engine() -> None:
    with pytest.raises(ConfigError, match="quantization"):
        EngineArgs.from_kwargs(quantization="int4")
    with pytest.raises(ConfigError, match="quantization"):
        load_model("unused", quantization="int4")
    assert EngineArgs.from_kwargs().quantization == "auto"
    for mode in ("none", "exact"):
        args = build_parser().parse_args(["serve", "--quantization", mode])
        assert EngineArgs.from_kwargs(**engine_kwargs_from_args(args)).quantization == mode
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int8"])
